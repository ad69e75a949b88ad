"""The P/D router: `kvstrata serve --role router`, an OpenAI front for P/D workers (no model).

app       the FastAPI app and its server: round robin over decode workers, streams relayed as they come
config    RouterConfig (the router's CLI options)
upstream  the workers of each role: health probes, skipped-while-down, next prefill for a decode
metrics   the router's `kvstrata:router_*` counters and latency histograms
"""

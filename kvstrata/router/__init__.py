"""The router: `kvstrata serve --role router`, an OpenAI front (no model) for P/D workers or for a
fleet of data-parallel replicas (--replicas).

app       the FastAPI app and its server: round robin over decode workers, streams relayed as they come
config    RouterConfig: everything the router reads (its listener: kvstrata.http.config.HttpConfig)
upstream  the workers of each role: health probes, skipped-while-down, next prefill for a decode
metrics   the router's `kvstrata:router_*` counters and latency histograms (FleetMetrics: a fleet's)
fleet     a fleet's per-request decision (prompt -> block hashes -> matches -> rule) and its check
rule      the routing rule: one pure function over matches, load and session
index     every replica's pages per medium, keyed by (cache_salt, block hash)
subscriber  one replica's KV event stream (SUB + replay) into the index
replicas  the routing set: health and load rounds, joins (info, subscriber) and leaves
dynamo    Dynamo's standalone KV indexer as the index (--kv-indexer-url)
fleet_start  the fleet's parts made at start
usage_watch  the usage read out of a relayed stream
"""

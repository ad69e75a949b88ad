"""Prefill/decode disaggregation: the workers' side (see docs/PD.md).

config     PDConfig (CLI options of `kvstrata serve --role prefill|decode`)
wire       hand-off messages: msgpack headers, page frames with xxh3-64 checksums, layouts
transport  a registry of transports by name (zmq: ROUTER on prefill, a DEALER per hand-off)
prefill    the prefill worker: verifies decode's keys, runs an engine request, sends the pages
decode     the decode worker: its lease holds what it has, the rest arrives from prefill
worker     wiring into the server's engine loop; routes: /v1/pd/info and the pd_* counters
"""

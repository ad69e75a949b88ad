"""Prefill/decode disaggregation: the workers' side (see docs/PD.md).

config     PDConfig (CLI options of `kvstrata serve --role prefill|decode`)
wire       hand-off messages: msgpack headers, page frames with xxh3-64 checksums, layouts
transport  a registry of transports by name (zmq: ROUTER on prefill, a DEALER per hand-off)
prefill    the prefill worker: verifies decode's keys, runs an engine request, sends the pages
holds      the pages prefill's engine holds until the listener has sent them (delayed free)
decode     the decode worker: its lease holds what it has, the rest arrives from prefill
ranks      RankPD: a worker's side on each of its ranks (one rank too), and the ranks' gates
worker     PDWorker: the worker's HTTP side (picks prefill workers, hears its ranks' reports)
reports    typed reports of the ranks to the HTTP side; metrics: RankCounts and the pd_* counters
layout     what a peer must share; routes: /v1/pd/info and /v1/pd/ranks
The router in front of the workers is its own package (kvstrata/router/); LocalPD, which starts a
router and two workers as local processes, is in kvstrata/bench/local_pd.py.
"""

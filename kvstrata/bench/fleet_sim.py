"""A fleet on paper: N replicas behind the router's routing rule, each the real cache and a FIFO.

Every replica is a Replayer (kvstrata/bench/replay.py: the real cache, its own device and host
pools) and a FifoServer (kvstrata/bench/simulate.py: its prefills in order, timed by the cost
model); all share one store, as a fleet shares Mooncake. Requests go in arrival order to the
replica the arm picks:
    round_robin  request i -> replica i mod N
    kv_aware     the router's rule (`choose`), fed what each replica's cache holds of the prompt
                 (a look that touches nothing: HiCache.peek), the shared store's prefix, and the
                 replica's load at the arrival (its requests whose first token is still to come)
The trace's sessions are unknown (Mooncake traces carry none), so a prompt no replica holds goes
to the least loaded one (ties broken by the hash of its first page: the rule's `spread`). Per arm
and N: hit rate by tier against the trace's infinite-capacity ceiling (one cache that never evicts), TTFT percentiles and the busiest replica's share of the
requests over the mean share.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from kvstrata.bench.costmodel import CostModel
from kvstrata.bench.reference import ceiling
from kvstrata.bench.replay import ReplayConfig, Replayer
from kvstrata.bench.simulate import FifoServer, Outcome, Timing, summarize
from kvstrata.router.config import RouterConfig
from kvstrata.router.rule import Candidate, choose, spread_key
from kvstrata.storage.base import StorageBackend, open_storage
from kvstrata.workloads.trace import Trace, TraceRequest

ROUTINGS: tuple[str, ...] = ("round_robin", "kv_aware")
MAX_REPLICAS = 64
TIERS = ("device", "host", "storage")
LOAD_WEIGHT: float = next(f.default for f in fields(RouterConfig) if f.name == "load_weight")
"""The router's default weight of one queued request against a whole prompt's prefill."""


class SimReplica:
    """One replica: its cache (a Replayer on the shared store) and its prefill FIFO."""

    def __init__(
        self, name: str, cfg: ReplayConfig, shared: StorageBackend | None, server: FifoServer
    ) -> None:
        self.name, self.server = name, server
        self.replayer = Replayer(cfg, shared)
        self.answer_at: list[float] = []  # heap: first-token times of requests not yet answered
        self.requests = 0

    def load(self, now_s: float) -> int:
        """Requests routed here that have not had their first token by `now_s`."""
        while self.answer_at and self.answer_at[0] <= now_s:
            heapq.heappop(self.answer_at)
        return len(self.answer_at)

    def candidate(self, keys: list[int], stored: int, now_s: float) -> Candidate:
        """What the router sees of this replica for a prompt of `keys` (`stored`: leading pages
        in the shared store)."""
        m = self.replayer.cache.peek(keys)
        host = m.device_pages + m.host_pages
        return Candidate(self.name, m.device_pages, host, max(host, stored), self.load(now_s))

    def serve(self, req: TraceRequest) -> tuple[Outcome, Timing, tuple[list[int], list[int]]]:
        out, hittable, cached = self.replayer.serve(req)
        timing = self.server.serve(out)
        heapq.heappush(self.answer_at, out.arrival_s * self.server.time_scale + timing.ttft_s)
        self.requests += 1
        return out, timing, (hittable, cached)

    def close(self) -> None:
        self.replayer.cache.check_integrity()
        self.replayer.close()


class Fleet:
    """N SimReplicas on one shared store, routed by one arm."""

    def __init__(
        self, n: int, base: ReplayConfig, cost: CostModel, routing: str, time_scale: float
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        if not 1 <= n <= MAX_REPLICAS:
            raise ValueError(f"replicas must be in [1, {MAX_REPLICAS}], got {n}")
        url = base.cache.storage_url
        self.shared = open_storage(url, base.page_nbytes) if url else None
        self.routing, self.sent = routing, 0
        self.replicas = [
            SimReplica(f"r{i}", base, self.shared, FifoServer(cost, time_scale)) for i in range(n)
        ]
        self._keys = self.replicas[0].replayer.keys  # every replica maps tokens alike

    def route(self, req: TraceRequest, now_s: float) -> SimReplica:
        self.sent += 1
        if self.routing == "round_robin":
            return self.replicas[(self.sent - 1) % len(self.replicas)]
        keys = self._keys.keys(req)
        stored = self.shared.exists_prefix(keys) if self.shared is not None else 0
        cands = [r.candidate(keys, stored, now_s) for r in self.replicas]
        spread = spread_key(keys[:1])
        name = choose(cands, len(keys), None, LOAD_WEIGHT, spread)
        return next(r for r in self.replicas if r.name == name)

    def close(self) -> None:
        for r in self.replicas:
            r.close()
        if self.shared is not None:
            self.shared.close()


def simulate_fleet(
    trace: Trace,
    base: ReplayConfig,
    cost: CostModel,
    n: int,
    routing: str,
    time_scale: float = 1.0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """One arm on N replicas: the trace in arrival order through the fleet; its figures."""
    fleet = Fleet(n, base, cost, routing, time_scale)
    outcomes: list[Outcome] = []
    timings: list[Timing] = []
    pairs: list[tuple[list[int], list[int]]] = []
    try:
        for i, req in enumerate(trace):
            out, timing, pair = fleet.route(req, req.arrival_s * time_scale).serve(req)
            outcomes.append(out)
            timings.append(timing)
            pairs.append(pair)
            if progress is not None:
                progress(i + 1)
        shares = [r.requests for r in fleet.replicas]
    finally:
        fleet.close()
    return _figures(n, routing, outcomes, timings, sum(ceiling(pairs)) * base.page_size, shares)


def _figures(
    n: int,
    routing: str,
    outcomes: Sequence[Outcome],
    timings: Sequence[Timing],
    ceiling_tokens: int,
    shares: Sequence[int],
) -> dict[str, Any]:
    prompt = sum(o.prompt for o in outcomes)
    tokens = {t: sum(getattr(o, t) for o in outcomes) for t in TIERS}
    by_tier = {t: n / prompt for t, n in tokens.items()}
    hit, ceil = sum(tokens.values()) / prompt, ceiling_tokens / prompt
    s = summarize(timings)
    return {
        "replicas": n,
        "routing": routing,
        "hit_rate": hit,
        "hit_rate_by_tier": by_tier,
        "ceiling": ceil,
        "hit_over_ceiling": hit / ceil if ceil else 0.0,
        **{k: s[k] for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")},
        "requests_per_replica": list(shares),
        "busiest_over_mean": max(shares) * len(shares) / max(sum(shares), 1),
    }


def fleet_study(
    trace: Trace,
    base: ReplayConfig,
    cost: CostModel,
    replicas: Sequence[int],
    routings: Sequence[str],
    time_scale: float = 1.0,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Every (N, arm) pair; `rows` in N order, and per arm how its figures change from the
    smallest N (ratios measured in this run)."""
    rows = []
    for n in replicas:
        for routing in routings:
            label = f"{routing} x{n}"
            cb = (lambda k, lab=label: progress(lab, k)) if progress else None
            rows.append(simulate_fleet(trace, base, cost, n, routing, time_scale, cb))
    return {"trace": trace.source, "time_scale": time_scale, "rows": rows, "trend": _trend(rows)}


def _trend(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, float]]]:
    """Per arm, each N's hit rate and TTFT p50 over those at the arm's smallest N."""
    out: dict[str, list[dict[str, float]]] = {}
    for routing in dict.fromkeys(r["routing"] for r in rows):
        arm = [r for r in rows if r["routing"] == routing]
        first = arm[0]
        out[routing] = [
            {
                "replicas": r["replicas"],
                "hit_rate_ratio": r["hit_rate"] / first["hit_rate"] if first["hit_rate"] else 0.0,
                "ttft_p50_ratio": r["ttft_p50_s"] / first["ttft_p50_s"]
                if first["ttft_p50_s"]
                else 0.0,
            }
            for r in arm
        ]
    return out

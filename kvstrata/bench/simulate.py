"""What-if simulator: a discrete-event FIFO over per-request cache outcomes from the real cache.

Two phases, exact for a FIFO instance: (1) the trace is replayed through the real cache manager in
arrival order (kvstrata/bench/replay.py), recording for each request how many prompt tokens came
from device, host and storage; (2) a single-server FIFO turns those outcomes into times with the
cost model. A FIFO serves requests in arrival order whatever the timings, and each prefill finishes
(and inserts its pages) before the next starts, so the cache sees exactly the order phase 1 used.

TTFT decomposition per request (seconds, all exposed time, summing to the TTFT):
    queue_s        waiting for the instance to free up
    prefetch_s     storage -> host time not hidden behind queueing (the prefetch starts at arrival)
    load_s         host -> device time not hidden behind layer compute
    compute_s      prefill FLOPs of the missed suffix (+ PP activation hops)
    gather_s       CP gather not hidden behind compute
    pd_transfer_s  P/D KV transfer not hidden behind compute
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstrata.bench.costmodel import CostModel

TERMS: tuple[str, ...] = (
    "queue_s",
    "prefetch_s",
    "load_s",
    "compute_s",
    "gather_s",
    "pd_transfer_s",
)


@dataclass(frozen=True)
class Outcome:
    """What the cache gave one request: prompt tokens served by each tier (the rest is computed)."""

    rid: int
    arrival_s: float
    prompt: int
    device: int = 0
    host: int = 0
    storage: int = 0
    storage_wait_s: float = 0.0
    """Time the request waited on its storage probe and prefetch (the replay's clock)."""

    @property
    def hit(self) -> int:
        return self.device + self.host + self.storage


@dataclass(frozen=True)
class Timing:
    """One request's TTFT and its decomposition (see module doc)."""

    rid: int
    ttft_s: float
    terms: dict[str, float]
    pd_bytes: float = 0.0  # KV bytes prefill sent decode (P/D topologies)


class FifoServer:
    """One instance serving prefills first in, first out, fed requests in arrival order (`fifo`
    feeds a whole trace; the fleet simulator feeds each replica the requests routed to it)."""

    def __init__(self, cost: CostModel, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.cost, self.time_scale = cost, time_scale
        self.free_at = 0.0  # when the instance (its first PP stage) takes the next prompt

    def serve(self, o: Outcome) -> Timing:
        """The request's TTFT and its terms; it must not arrive before the one served last."""
        c = self.cost.costs(o.prompt, o.device, o.host, o.storage)
        arrival = o.arrival_s * self.time_scale
        start = max(self.free_at, arrival + c.prefetch_s)  # waits for the instance and prefetch
        queue = min(max(0.0, self.free_at - arrival), start - arrival)
        first_token = start + c.load_s + c.compute_s + c.gather_s + c.pd_transfer_s
        terms = {
            "queue_s": queue,
            "prefetch_s": (start - arrival) - queue,
            "load_s": c.load_s,
            "compute_s": c.compute_s,
            "gather_s": c.gather_s,
            "pd_transfer_s": c.pd_transfer_s,
        }
        # PP: the next prompt enters stage 0 once this one left it (about 1/pp of the busy time).
        self.free_at = start + c.busy_s / self.cost.topo.pp
        return Timing(o.rid, first_token - arrival, terms, c.pd_bytes)


def fifo(outcomes: Sequence[Outcome], cost: CostModel, time_scale: float = 1.0) -> list[Timing]:
    """Run the single-instance FIFO; `time_scale` stretches arrival times (2.0 = half the rate)."""
    server = FifoServer(cost, time_scale)
    return [server.serve(o) for o in sorted(outcomes, key=lambda o: (o.arrival_s, o.rid))]


def summarize(timings: Sequence[Timing]) -> dict[str, object]:
    """TTFT percentiles and the mean of each decomposition term (which sum to the mean TTFT)."""
    if not timings:
        raise ValueError("no requests to summarise")
    ttft = np.array([t.ttft_s for t in timings])
    p50, p90, p99 = (float(x) for x in np.percentile(ttft, [50, 90, 99]))
    mean_terms = {k: float(np.mean([t.terms[k] for t in timings])) for k in TERMS}
    return {
        "requests": len(timings),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": p50,
        "ttft_p90_s": p90,
        "ttft_p99_s": p99,
        "decomposition": mean_terms,
        "pd_bytes_sent": float(sum(t.pd_bytes for t in timings)),
    }


def no_cache(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The same requests with every hit removed (the "cache off" row)."""
    return [Outcome(o.rid, o.arrival_s, o.prompt) for o in outcomes]

"""Prefix-cache reset (`POST /reset_prefix_cache`) and the recompute preemption it may need.

Both change agreed state only: under ranks they run between the same two steps on every rank
(a rank call), and the drain of copies in flight goes through the engine's `agree`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvstrata.engine.request import State

if TYPE_CHECKING:
    from kvstrata.engine.engine import Engine

RESET_DRAIN_S = 120.0  # a prefix-cache reset waits this long at most for copies in flight


def preempt_running(engine: Engine) -> int:
    """Send every running request back to the head of the queue, its pages given back (the full
    ones stay cached): readmitted, it recomputes its prompt and the tokens it made so far (vLLM's
    recompute preemption) and goes on; `req.hits` is left as is, so the usage it reports keeps
    its first admission's hits. Returns how many were preempted."""
    n = len(engine.running)
    for req in reversed(engine.running):
        engine.admission.cache_pages(req, final=True)
        req.lease, req.computed, req.draft_computed = None, 0, None
        req.state = State.WAITING
        engine.waiting.insert(0, req)
    engine.running.clear()
    return n


def reset_prefix_cache(engine: Engine, reset_running: bool, drop_host: bool) -> bool:
    """Forget every cached L1 page (drop_host: L2 too; never L3). False, changing nothing, while
    requests run and reset_running is off, or while a P/D hand-off is in flight (its pages are
    being written by another worker: it cannot be preempted)."""
    cache = engine.cache
    if cache is None:
        return True
    if engine.running and (not reset_running or any(r.remote for r in engine.running)):
        return False
    preempt_running(engine)
    for req in engine.waiting:  # waiting leases let go of their locks; they match again later
        if req.lease is not None:
            req.lease.release()
            req.lease = None
    deadline = time.monotonic() + RESET_DRAIN_S
    while len(cache.queues):  # every copy lands (agreed: the same loop on every rank)
        if not cache.apply(engine.agree(cache.local_progress())):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"prefix-cache reset: {len(cache.queues)} cache copies still pending "
                    f"after {RESET_DRAIN_S:g} s"
                )
            time.sleep(0.0005)
    return cache.reset_prefix(drop_host)

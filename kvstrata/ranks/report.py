"""What one rank reports back at the end of a distributed run (kvstrata.ranks.rank_engine), and
the testing watch over the bytes of the pages it restored and cached (RankOptions.report_pages)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvstrata.engine.request import Request, State
from kvstrata.engine.step_result import StepResult
from kvstrata.memory.pool import DevicePool


class PageWatch:
    """This rank's part of every page a request restored from the cache (its hit pages, read
    once its first forward waited for their loads) and cached (read when the first request
    holding it finishes): key -> uint8 bytes [layers, 2, page, kv_heads, head_dim] of the
    pages this rank owns."""

    def __init__(self, pool: DevicePool) -> None:
        self.pool = pool
        self.restored: dict[str, dict[int, np.ndarray]] = {}
        self.cached: dict[int, np.ndarray] = {}
        self.watched: dict[str, Request] = {}  # admitted, hit pages not read yet

    def after_step(self, result: StepResult) -> None:
        """One engine step's result: admitted requests are watched until their hit pages are
        final; ended ones give their cached pages."""
        for req in result.admitted:
            self.watched.setdefault(req.rid, req)
        for req in [*self.watched.values(), *result.ended]:
            lease = req.lease
            if req.rid in self.restored or lease is None or req.state is State.WAITING:
                continue
            if lease.load is None:  # no host -> device copy in flight: the hit pages are final
                n = sum(req.hits.values())
                self.restored[req.rid] = self._owned(lease.keys[:n], lease.page_table[:n])
        for rid in [rid for rid in self.watched if rid in self.restored]:
            del self.watched[rid]
        for req in result.ended:
            self.watched.pop(req.rid, None)
            lease = req.lease
            if lease is not None:
                n = lease.inserted
                for key, page in self._owned(lease.keys[:n], lease.page_table[:n]).items():
                    self.cached.setdefault(key, page)  # as first cached: a later hit's copy
                    # (restored, then cached again) must not stand in for the cold bytes

    def _owned(self, keys: list[int], ids: list[int]) -> dict[int, np.ndarray]:
        pool = self.pool
        return {  # bytes, not values: any dtype, compared bit for bit
            k: pool.data[:, :, pool.local_slot(p)].contiguous().view(torch.uint8).numpy()
            for k, p in zip(keys, ids, strict=True)
            if pool.owns(p)
        }

    def report(self) -> dict[str, Any]:
        return {"restored_pages": self.restored, "cached_pages": self.cached}


def requests_report(done: list[Request]) -> dict[str, Any]:
    """What any rank, one or many, reports of the requests it finished, by request id."""
    return {
        "outputs": {r.rid: list(r.output) for r in done},
        # numpy, not tensors: torch's queue would pass tensors as shared memory of a dying process
        "logits": {r.rid: [x.numpy().copy() for x in r.logits] for r in done if r.keep_logits},
        "hits": {r.rid: dict(r.hits) for r in done},
        "ttft": {r.rid: r.ttft_s for r in done},
        "spec_accepts": {r.rid: list(r.spec_accepts) for r in done},
        "spec_proposed": {r.rid: r.spec_proposed for r in done},
    }


def rank_result(re: Any, done: list[Request]) -> dict[str, Any]:
    """What a rank reports back: outputs, logits, hits, digests, its share of the cached pages."""
    cache, ctx = re.cache, re.ctx
    owned = total = 0
    host: dict[str, Any] = {}
    if cache is not None:
        ids = [d for n in cache.tree.nodes() if n.device is not None for d in n.device]
        total, owned = len(ids), sum(1 for d in ids if re.pool.owns(d))
        host = _host_report(re)
    return {
        "rank": ctx.rank,
        **requests_report(done),
        "counters": re.cache.counters.as_dict() if re.cache is not None else None,
        "digests": list(re.digests),
        "cached_device_pages": total,
        "owned_device_pages": owned,
        "pool_slots": re.pool.capacity_local,
        "steps": re.engine.steps,
        "tokens_computed": getattr(re.engine.model, "tokens_computed", None),
        "peak_scratch": getattr(re.engine.scheduler.limit, "peak", None),
        "collectives_per_step": re.consensus.collectives_per_step if re.consensus else 0.0,
        "spec": re.engine.spec_stats(),
        "spec_fingerprint": re.engine.spec.fingerprint if re.engine.spec is not None else "",
        "part": (re.part.layers, re.part.heads),
        **(re.pages.report() if re.pages is not None else {}),
        **host,
    }


def _host_report(re: Any) -> dict[str, Any]:
    """This rank's host memory: cached host pages it owns (by id), its slots and bytes; mover
    counts."""
    assert re.cache is not None and re.mover is not None
    pool = re.mover.host
    ids = [h for n in re.cache.tree.nodes() if n.host is not None for h in n.host]
    out: dict[str, Any] = {"mover": re.mover.stats(), "cached_host_pages": len(ids)}
    if re.mover.storage is not None:  # this rank's UnitStorage
        out["storage"] = re.mover.storage.stats()
    if pool is not None:
        out["owned_host_pages"] = sum(1 for h in ids if pool.owns(h))
        out["host_slots"] = pool.capacity_local
        out["host_bytes"] = pool.data.numel() * pool.data.element_size()
        if re.options.report_host_pages:
            pairs = [
                (k, h)
                for n in re.cache.tree.nodes()
                if n.host
                for k, h in zip(n.keys, n.host, strict=True)
            ]
            out["host_pages"] = {k: pool.page_bytes(h).copy() for k, h in pairs if pool.owns(h)}
    return out

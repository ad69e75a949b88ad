"""`kvstrata bench parallel`: parallel KV placement costs, measured on real local gloo ranks.

- storage backup throughput per rank and in total at tp=1, tp=2 and cp=2: every rank's TensorMover
  backs up the same logical pages (its part, its own pages) into one file store of units;
  total = all bytes written / the slowest rank's time. Also the backup bytes rank 0 handled
  that belong to other ranks (goal 0: nothing is gathered).
- Host bytes per rank under cp=1 and cp=2 (the pools each rank allocates for the same config).
- The step consensus with and without the live digest (StepConsensus live_check), interleaved.
- Cache overhead per request against prompt length: keys + match + insert on the tensor-free
  cache (KeySetMover), time and tracemalloc peak per page at 8k, 32k, 128k tokens.
"""

from __future__ import annotations

import os
import tempfile
import time
import tracemalloc
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvstrata.bench.registry import BENCHES
from kvstrata.cache.config import CacheConfig
from kvstrata.cache.hicache import HiCache
from kvstrata.cache.keys import Namespace, page_keys
from kvstrata.cache.movers import KeySetMover
from kvstrata.cache.ops import BACKUP, TransferOp
from kvstrata.memory.allocator import PageAllocator
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool, HostPool
from kvstrata.memory.transfer import RankShare, TensorMover
from kvstrata.model_parallel.tp import head_range
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.consensus import StepConsensus
from kvstrata.ranks.decision_log import DecisionLog
from kvstrata.ranks.group import RankContext, run_ranks
from kvstrata.storage.units import PagePart, open_unit_storage

# A small model-shaped page: 4 layers, 4 K/V heads, head_dim 64, 16 tokens, fp32 = 128 KiB.
SHAPE = KVShape(4, 4, 64, 16)


def _backup_rank(ctx: RankContext, url: str, pages: int) -> dict[str, Any]:
    """Back up `pages` pages through this rank's TensorMover; time until its part is written."""
    cfg = ctx.config
    part = PagePart(
        SHAPE, (0, SHAPE.num_layers), head_range(SHAPE.num_kv_heads, cfg.tp, ctx.tp_rank)
    )
    dev = DevicePool(part.shape, 2 * cfg.cp, n_shards=cfg.cp, rank=ctx.cp_rank)
    host = HostPool(part.shape, pages, pin_memory=False, n_shards=cfg.cp, rank=ctx.cp_rank)
    host.data.copy_(torch.randn(host.data.shape))
    store = open_unit_storage(url, part, commit_on_put=False)
    mover = TensorMover(dev, host, store, RankShare(commit_writer=ctx.tp_rank == 0))
    keys = [1_000_003 + i for i in range(pages)]  # the same logical pages on every rank
    op = TransferOp(BACKUP, list(range(pages)), [], keys=keys)
    dist.barrier()
    t0 = time.perf_counter()
    mover.submit(op)
    while mover.poll(op) is None:
        time.sleep(0.0002)
    elapsed = time.perf_counter() - t0
    mover.close()
    store.close()
    stats = mover.stats()
    return {"s": elapsed, "bytes": stats["backup_bytes"], "foreign": stats["foreign_backup_bytes"]}


def _backup(tp: int, cp: int, pages: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-par-") as d:
        res = run_ranks(_backup_rank, DistConfig(tp=tp, cp=cp), (d, pages), timeout_s=300)
    total = sum(r["bytes"] for r in res)
    assert total == pages * SHAPE.page_nbytes, (total, pages * SHAPE.page_nbytes)
    slowest = max(r["s"] for r in res)
    return {
        "ranks": len(res),
        "gbps_total": round(total / slowest / 1e9, 4),
        "gbps_per_rank": [round(r["bytes"] / r["s"] / 1e9, 4) for r in res],
        "bytes_per_rank": [r["bytes"] for r in res],
        "rank0_foreign_bytes": res[0]["foreign"],
    }


def _host_bytes(pages: int, cp: int) -> list[int]:
    pools = [HostPool(SHAPE, pages, pin_memory=False, n_shards=cp, rank=r) for r in range(cp)]
    return [p.data.numel() * p.data.element_size() for p in pools]


def _consensus_rank(ctx: RankContext, steps: int) -> dict[str, list[float]]:
    fields = [f"p{i}" for i in range(10)]
    runs = {True: StepConsensus(fields, live_check=True), False: StepConsensus(fields)}
    logs = {live: DecisionLog(ctx.rank) for live in runs}
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(steps):
        for live in (step % 2 == 0, step % 2 == 1):  # alternate which goes first
            log = logs[live]
            log.begin_step(step)
            log.record("apply", n=step)
            log.end_step(step)
            dist.barrier()
            t0 = time.perf_counter()
            runs[live].agree(step, {f: step for f in fields}, log)
            times[live].append(time.perf_counter() - t0)
    return {"live": times[True], "plain": times[False]}


def _consensus(steps: int) -> dict[str, float]:
    res = run_ranks(_consensus_rank, DistConfig(tp=2), (steps,), timeout_s=300)
    live = np.median(np.max([r["live"] for r in res], axis=0)[1:])
    plain = np.median(np.max([r["plain"] for r in res], axis=0)[1:])
    return {
        "ms_p50_with_digest": round(float(live) * 1e3, 4),
        "ms_p50_without_digest": round(float(plain) * 1e3, 4),
        "digest_overhead": round(float(live / plain - 1.0), 4),
    }


def _overhead(tokens: int, page: int = 16) -> dict[str, float]:
    """One request's cache work at `tokens`: page keys, match, alloc, insert (tensor-free)."""
    n = tokens // page
    cfg = CacheConfig(page_size=page, device_pages=n + page, host_pages=0)
    cache = HiCache(cfg, PageAllocator(cfg.device_pages), None, KeySetMover())
    toks = np.random.default_rng(tokens).integers(0, 32000, tokens, dtype=np.int32)
    ns = Namespace("bench", "float32", page_size=page)
    tracemalloc.start()
    t0 = time.perf_counter()
    keys = page_keys(toks, ns)
    m = cache.match(keys)
    ids = cache.alloc_device(n - m.pages)
    assert ids is not None
    cache.insert(keys, m.device_ids + ids)
    cache.match(keys)  # the hit of the next turn
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    cache.check_integrity()
    return {
        "tokens": tokens,
        "ms": round(elapsed * 1e3, 3),
        "us_per_page": round(elapsed / n * 1e6, 3),
        "peak_bytes_per_page": round(peak / n, 1),
    }


@BENCHES.register("parallel")
def bench_parallel(quick: bool) -> dict[str, Any]:
    pages = 64 if quick else 512
    tp1, tp2, cp2 = _backup(1, 1, pages), _backup(2, 1, pages), _backup(1, 2, pages)
    host1, host2 = _host_bytes(1024, 1), _host_bytes(1024, 2)
    cons = _consensus(200 if quick else 1000)
    lengths = (8192, 32768) if quick else (8192, 32768, 131072)
    over = [_overhead(n) for n in lengths]
    return {
        "page_bytes": SHAPE.page_nbytes,
        "backup_pages": pages,
        "backup_gbps_tp1": tp1["gbps_total"],
        "backup_gbps_tp2": tp2["gbps_total"],
        "backup_gbps_cp2": cp2["gbps_total"],
        "backup_gbps_per_rank_tp2": tp2["gbps_per_rank"],
        "backup_gbps_per_rank_cp2": cp2["gbps_per_rank"],
        "backup_bytes_per_rank_tp2": tp2["bytes_per_rank"],
        "backup_bytes_per_rank_cp2": cp2["bytes_per_rank"],
        "rank0_foreign_backup_bytes": max(
            tp1["rank0_foreign_bytes"], tp2["rank0_foreign_bytes"], cp2["rank0_foreign_bytes"]
        ),
        "host_bytes_per_rank_cp1": host1[0],
        "host_bytes_per_rank_cp2": max(host2),
        "host_bytes_per_rank_ratio_cp2": round(max(host2) / host1[0], 4),
        **cons,
        "cache_overhead": over,
        "cache_us_per_page_ratio_longest_vs_8k": round(
            over[-1]["us_per_page"] / over[0]["us_per_page"], 3
        ),
        "goal_host_bytes_ratio": 0.5,
        "goal_digest_overhead": 0.05,
        "cpu_count": os.cpu_count() or 0,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }

"""Replay a trace through the real cache manager (keys, tree, tiers, policies, storage backend).

One request at a time, in arrival order:
    match the hittable pages -> probe L3 and prefetch what it holds into L2 -> re-match ->
    load L2 pages into L1 -> allocate L1 pages for the rest -> model.prefill -> insert -> drain.
The hittable pages are the full pages inside the first input_length - 1 tokens (the last token
is always computed, for the logits); a finished request leaves prompt (+ output) pages cached.

The model is pluggable through REPLAY_MODELS: "synthetic" (kvstrata/bench/synthetic.py) moves no
tensors and writes deterministic, checked page bytes to L3. REGISTRATION POINT for a real-engine
model: `@REPLAY_MODELS.register("engine")` a factory `(cfg: ReplayConfig) -> ReplayModel` whose
`mover()` is the engine's copy engine + storage and whose `prefill()` computes the missed suffix
into the given L1 page ids; add its module to MODEL_MODULES.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstrata.bench.reference import ceiling, hittable_pages
from kvstrata.bench.simulate import Outcome
from kvstrata.bench.synthetic import MemoryStorage, SyntheticMover
from kvstrata.cache.config import CacheConfig
from kvstrata.cache.keys import Namespace
from kvstrata.cache.manager import HiCache
from kvstrata.cache.ops import PageMover, TransferOp
from kvstrata.cache.radix import Match
from kvstrata.configtools import doc
from kvstrata.memory.allocator import PageAllocator
from kvstrata.registry import Registry
from kvstrata.storage.base import StorageBackend, open_storage
from kvstrata.workloads.trace import DEFAULT_VOCAB, KeyMapper, TokenMapper, Trace, TraceRequest


@dataclass(frozen=True)
class ReplayConfig:
    """Trace replay: tier capacities in tokens, cache policies, the model that fills pages."""

    model: str = doc(
        "synthetic", "replay model: synthetic (KV bytes, no compute) or engine (the real model)"
    )
    model_path: str = doc("", "engine model: HF checkpoint dir; empty = SmolLM2-135M-Instruct")
    page_size: int = doc(64, "tokens per page")
    l1_tokens: int = doc(10_000_000, "L1 (device) capacity in tokens")
    l2_tokens: int = doc(30_000_000, "L2 (host) capacity in tokens; 0 disables L2 (and L3)")
    l3: str = doc(
        "mem", "L3: 'mem' (in-process store), 'off', or a storage URL (file:///dir, redis://...)"
    )
    l3_tokens: int = doc(0, "capacity of the 'mem' L3 in tokens (0 = unbounded)")
    eviction: str = doc("lru", "eviction policy (lru, lfu)")
    write_policy: str = doc("write_through", "write_through, write_through_selective, write_back")
    prefetch_policy: str = doc("best_effort", "best_effort, wait_complete, timeout")
    page_nbytes: int = doc(
        64, "synthetic KV bytes per page written to L3 (tiny: only decisions matter)"
    )
    vocab_size: int = doc(DEFAULT_VOCAB, "token ids of mapped hash ids are < vocab_size")
    check_every: int = doc(
        0, "run the cache's check_integrity every N requests (0: only at the end)"
    )

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_nbytes <= 0:
            raise ValueError("page_size and page_nbytes must be > 0")
        if self.l1_tokens < self.page_size:
            raise ValueError(
                f"l1_tokens must hold at least one page ({self.page_size} tokens), got {self.l1_tokens}"
            )
        if self.l2_tokens < 0 or self.l3_tokens < 0 or self.check_every < 0:
            raise ValueError("l2_tokens, l3_tokens and check_every must be >= 0")

    @property
    def tiers(self) -> str:
        has_l2 = self.l2_tokens >= self.page_size
        return "L1" + ("+L2" if has_l2 else "") + ("+L3" if has_l2 and self.l3 != "off" else "")

    def cache_config(self) -> CacheConfig:
        host = self.l2_tokens // self.page_size
        return CacheConfig(
            page_size=self.page_size,
            device_pages=self.l1_tokens // self.page_size,
            host_pages=host,
            storage_url=self.l3 if host and self.l3 != "off" else "",
            eviction=self.eviction,
            write_policy=self.write_policy,
            prefetch_policy=self.prefetch_policy,
        )


class ReplayModel(Protocol):
    """What fills the pages of the missed suffix."""

    page_nbytes: int

    def mover(self, storage: StorageBackend | None) -> PageMover: ...

    def prefill(
        self, req: TraceRequest, hit_tokens: int, page_ids: list[int], load: TransferOp | None
    ) -> None:
        """Compute prompt tokens [hit_tokens, input_length) into L1 `page_ids` (one per full page
        of prompt + output); `load` is the L2 -> L1 copy of the hit pages to wait on per layer."""

    def close(self) -> None: ...


REPLAY_MODELS: Registry[ReplayModel] = Registry("replay model")
MODEL_MODULES: tuple[str, ...] = ("kvstrata.bench.engine_model",)
"""Modules that register more replay models on import (e.g. the engine's)."""


@REPLAY_MODELS.register("synthetic")
class SyntheticModel:
    """No compute: the cache decisions and L3 page bytes are real, the KV values are synthetic."""

    def __init__(self, cfg: ReplayConfig) -> None:
        self.page_nbytes = cfg.page_nbytes
        self._mover: SyntheticMover | None = None

    def mover(self, storage: StorageBackend | None) -> PageMover:
        self._mover = SyntheticMover(storage, self.page_nbytes)
        return self._mover

    def prefill(
        self, req: TraceRequest, hit_tokens: int, page_ids: list[int], load: TransferOp | None
    ) -> None:
        """Nothing to compute; the bytes that matter are written at backup time."""

    def close(self) -> None:
        pass


def _open_l3(cfg: ReplayConfig, page_nbytes: int) -> StorageBackend | None:
    if cfg.l3 == "off" or cfg.l2_tokens < cfg.page_size:
        return None
    if cfg.l3 == "mem":
        return MemoryStorage(page_nbytes, cfg.l3_tokens // cfg.page_size)
    return open_storage(cfg.l3, page_nbytes)


@dataclass
class ReplayResult:
    config: ReplayConfig
    outcomes: list[Outcome]
    ceiling_tokens: int
    wall_s: float
    stats: dict[str, Any]
    storage_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(o.prompt for o in self.outcomes)

    def hit_tokens_by_tier(self) -> dict[str, int]:
        return {t: sum(getattr(o, t.lower()) for o in self.outcomes) for t in ("L1", "L2", "L3")}

    def report(self) -> dict[str, Any]:
        total = self.prompt_tokens
        by_tier = self.hit_tokens_by_tier()
        hits = sum(by_tier.values())
        return {
            "requests": len(self.outcomes),
            "prompt_tokens": total,
            "hit_tokens": hits,
            "hit_rate": hits / total,
            "hit_rate_by_tier": {t: n / total for t, n in by_tier.items()},
            "ceiling": self.ceiling_tokens / total,
            "tiers": self.config.tiers,
            "bytes_moved": self.stats["bytes_moved"],
            "pages_moved": self.stats["pages_moved"],
            "evictions": self.stats["evictions"],
            "prefetch": self.stats["prefetch"],
            "wall_s": self.wall_s,
            "tokens_per_s": total / self.wall_s if self.wall_s > 0 else 0.0,
            "storage": self.storage_stats,
            "config": {k: getattr(self.config, k) for k in self.config.__dataclass_fields__},
        }


class Replayer:
    """Owns one cache and serves requests through it one by one."""

    def __init__(self, cfg: ReplayConfig) -> None:
        for mod in MODEL_MODULES:
            importlib.import_module(mod)
        self.cfg = cfg
        self.model = REPLAY_MODELS.create(cfg.model, cfg)
        self.storage = _open_l3(cfg, self.model.page_nbytes)
        cc = cfg.cache_config()
        host = PageAllocator(cc.host_pages) if cc.host_pages else None
        self.cache = HiCache(
            cc,
            PageAllocator(cc.device_pages),
            host,
            self.model.mover(self.storage),
            has_storage=self.storage is not None,
            page_nbytes=self.model.page_nbytes,
        )
        self.keys = KeyMapper(Namespace(page_size=cfg.page_size), TokenMapper(cfg.vocab_size))
        self.uncached = 0  # requests whose new pages did not fit in L1

    def _from_storage(self, mkeys: list[int], m: Match) -> Match:
        """Probe L3 for the pages after the L1 + L2 prefix, prefetch the hit into L2, re-match."""
        probe = self.cache.start_probe(mkeys[m.pages :])
        if probe is None:
            return m
        self.cache.drain()
        n = probe.agreed or 0
        if n == 0 or self.cache.start_prefetch(mkeys[m.pages : m.pages + n], m.last_node) is None:
            return m
        self.cache.drain()
        self.cache.unlock(m.last_node)  # type: ignore[arg-type]
        m2 = self.cache.match(mkeys)
        self.cache.lock(m2.last_node)  # type: ignore[arg-type]
        return m2

    def serve(self, req: TraceRequest) -> tuple[Outcome, list[int], list[int]]:
        """Run one request; returns its outcome, hittable keys and the keys it leaves cached."""
        page, cache = self.cfg.page_size, self.cache
        keys = self.keys.keys(req)
        ins = self.keys.output_keys(req, keys)
        mkeys = keys[: hittable_pages(req.input_length, page)]
        m = cache.match(mkeys)
        cache.lock(m.last_node)  # type: ignore[arg-type]
        l1, l2 = m.device_pages, m.host_pages
        if self.storage is not None and m.pages < len(mkeys):
            m = self._from_storage(mkeys, m)
        l3 = m.pages - l1 - l2
        load = cache.load_host(m)
        if load is None:  # L1 too full of locked pages to take the host hit: compute it instead
            l2 = l3 = 0
        have = l1 + l2 + l3
        new_ids = cache.alloc_device(len(ins) - have) if len(ins) > have else []
        if new_ids is None:
            self.uncached += 1
        else:
            ids = m.device_ids + (list(load.dst) if load is not None else []) + new_ids
            self.model.prefill(req, have * page, ids, load)
            cache.insert(ins[: len(ids)], ids)
        cache.unlock(m.last_node)  # type: ignore[arg-type]
        cache.counters.record_request(len(mkeys), l1, l2, l3)
        cache.drain()
        return (
            Outcome(req.rid, req.arrival_s, req.input_length, l1 * page, l2 * page, l3 * page),
            mkeys,
            ins,
        )

    def run(self, trace: Trace, progress: Callable[[int], None] | None = None) -> ReplayResult:
        """Replay every request; `progress(n)` is called after each one."""
        outcomes: list[Outcome] = []
        pairs: list[tuple[list[int], list[int]]] = []
        t0 = time.perf_counter()
        for i, req in enumerate(trace):
            out, mkeys, ins = self.serve(req)
            outcomes.append(out)
            pairs.append((mkeys, ins))
            if self.cfg.check_every and (i + 1) % self.cfg.check_every == 0:
                self.cache.check_integrity()
            if progress is not None:
                progress(i + 1)
        wall = time.perf_counter() - t0
        self.cache.check_integrity()
        ceil_tokens = sum(ceiling(pairs)) * self.cfg.page_size
        stats = self.cache.stats()
        stats["uncached_requests"] = self.uncached
        sstats = dict(self.storage.stats()) if self.storage is not None else {}
        if isinstance(self.model, SyntheticModel) and self.model._mover is not None:
            sstats["corrupt_pages"] = self.model._mover.corrupt_pages
        return ReplayResult(self.cfg, outcomes, ceil_tokens, wall, stats, sstats)

    def close(self) -> None:
        self.model.close()
        if self.storage is not None:
            self.storage.close()


def replay(
    trace: Trace, cfg: ReplayConfig, progress: Callable[[int], None] | None = None
) -> ReplayResult:
    """Replay `trace` under `cfg` with a fresh cache."""
    r = Replayer(cfg)
    try:
        return r.run(trace, progress)
    finally:
        r.close()

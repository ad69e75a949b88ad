"""Replay a trace through the real cache (keys, tree, tiers, policies, storage backend).

One request at a time, in arrival order, each driving its lease (kvstrata.cache.lease): match,
storage probe and prefetch under the prefetch policy, re-match, host -> device load, allocation of
the rest, model.prefill, insert, release. A finished request leaves prompt (+ output) pages cached.
With the synthetic model, time is a step clock: a storage read takes `storage_first_byte_s +
storage_page_s * pages` and a waiting request costs `step_s` per step, so the prefetch policies give
different hit rates and waits (best_effort never waits here: nothing else runs, so the request
can always be scheduled at once).

The model is pluggable through REPLAY_MODELS: "synthetic" (kvstrata/bench/synthetic.py) moves no
tensors and writes deterministic, checked page bytes to storage; "engine"
(kvstrata/bench/engine_model.py) computes every missed page with the real model.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstrata.bench.reference import ceiling
from kvstrata.bench.simulate import Outcome
from kvstrata.bench.synthetic import StorageLatency, SyntheticMover
from kvstrata.cache.config import CacheConfig
from kvstrata.cache.hicache import HiCache
from kvstrata.cache.keys import Namespace
from kvstrata.cache.lease import Lease, LeaseState
from kvstrata.cache.ops import PageMover, TransferOp
from kvstrata.configtools import doc
from kvstrata.memory.allocator import PageAllocator
from kvstrata.registry import Registry
from kvstrata.storage.base import StorageBackend, open_storage
from kvstrata.workloads.trace import DEFAULT_VOCAB, KeyMapper, TokenMapper, Trace, TraceRequest


@dataclass(frozen=True)
class ReplayConfig:
    """Trace replay: the cache (its own config), the model that fills pages, storage timing."""

    cache: CacheConfig = doc(CacheConfig(), "the cache under test", cli=False)
    model: str = doc(
        "synthetic", "replay model: synthetic (KV bytes, no compute) or engine (the real model)"
    )
    model_path: str = doc("", "engine model: HF checkpoint dir; empty = SmolLM2-135M-Instruct")
    page_nbytes: int = doc(
        64, "synthetic KV bytes per page written to storage (tiny: only decisions matter)"
    )
    storage_first_byte_s: float = doc(
        0.002, "synthetic storage read: time to the first byte (seconds)"
    )
    storage_page_s: float = doc(
        0.01, "synthetic storage read: seconds per page (a 20 MB 70B-class page at 2 GB/s)"
    )
    step_s: float = doc(0.005, "synthetic clock: one scheduler step while a request waits")
    max_wait_s: float = doc(600.0, "a request waiting on storage longer than this is an error")
    vocab_size: int = doc(DEFAULT_VOCAB, "token ids of mapped hash ids are < vocab_size")
    check_every: int = doc(
        0, "run the cache's check_integrity every N requests (0: only at the end)"
    )

    def __post_init__(self) -> None:
        if self.page_nbytes <= 0:
            raise ValueError("page_nbytes must be > 0")
        if min(self.storage_first_byte_s, self.storage_page_s, self.check_every) < 0:
            raise ValueError("storage_first_byte_s, storage_page_s and check_every must be >= 0")
        if self.step_s <= 0 or self.max_wait_s <= 0:
            raise ValueError("step_s and max_wait_s must be > 0")

    @classmethod
    def sized(
        cls, device_tokens: int, host_tokens: int = 0, storage_url: str = "", **fields: Any
    ) -> ReplayConfig:
        """A replay whose tier capacities are given in tokens; other keyword arguments go to
        the CacheConfig field or the ReplayConfig field of that name."""
        cache_names = {f.name for f in dataclasses.fields(CacheConfig)}
        cache_kw = {k: fields.pop(k) for k in list(fields) if k in cache_names}
        page = cache_kw.get("page_size", CacheConfig.page_size)
        if device_tokens < page:
            raise ValueError(f"device_tokens must hold at least one page ({page} tokens)")
        cache = CacheConfig(
            device_pages=device_tokens // page,
            host_pages=host_tokens // page,
            storage_url=storage_url if host_tokens >= page else "",
            **cache_kw,
        )
        return cls(cache=cache, **fields)

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    @property
    def tiers(self) -> str:
        c = self.cache
        return "device" + ("+host" if c.host_pages else "") + ("+storage" if c.storage_url else "")

    @property
    def latency(self) -> StorageLatency:
        return StorageLatency(self.storage_first_byte_s, self.storage_page_s)


class ReplayModel(Protocol):
    """What fills the pages of the missed suffix."""

    page_nbytes: int
    virtual_time: bool
    """True: ops take time on the replay's step clock; False: real copies, wall time."""

    def mover(self, storage: StorageBackend | None, clock: Callable[[], float]) -> PageMover: ...

    def prefill(
        self, req: TraceRequest, hit_tokens: int, page_ids: list[int], load: TransferOp | None
    ) -> None:
        """Compute prompt tokens [hit_tokens, input_length) into the device pages `page_ids` (one
        per full page of prompt + output); `load` is the host -> device copy of the hit pages to
        wait on per layer."""

    def close(self) -> None: ...


REPLAY_MODELS: Registry[ReplayModel] = Registry("replay model")
MODEL_MODULES: tuple[str, ...] = ("kvstrata.bench.engine_model",)
"""Modules that register more replay models on import (e.g. the engine's)."""


@REPLAY_MODELS.register("synthetic")
class SyntheticModel:
    """No compute: the cache decisions and storage page bytes are real, the KV values are
    synthetic."""

    virtual_time = True

    def __init__(self, cfg: ReplayConfig) -> None:
        self.page_nbytes = cfg.page_nbytes
        self.latency = cfg.latency
        self._mover: SyntheticMover | None = None

    def mover(self, storage: StorageBackend | None, clock: Callable[[], float]) -> PageMover:
        self._mover = SyntheticMover(storage, self.page_nbytes, self.latency, clock)
        return self._mover

    def prefill(
        self, req: TraceRequest, hit_tokens: int, page_ids: list[int], load: TransferOp | None
    ) -> None:
        """Nothing to compute; the bytes that matter are written at backup time."""

    def close(self) -> None:
        pass


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
        return {
            t: sum(getattr(o, t.lower()) for o in self.outcomes)
            for t in ("device", "host", "storage")
        }

    def report(self) -> dict[str, Any]:
        total = self.prompt_tokens
        by_tier = self.hit_tokens_by_tier()
        waits = [o.storage_wait_s for o in self.outcomes]
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
            "prefetch_policy": self.config.cache.prefetch_policy,
            "storage_wait_s_total": sum(waits),
            "storage_wait_s_max": max(waits, default=0.0),
            "wall_s": self.wall_s,
            "tokens_per_s": total / self.wall_s if self.wall_s > 0 else 0.0,
            "storage": self.storage_stats,
            "config": dataclasses.asdict(self.config),
        }


class Replayer:
    """Owns one cache and serves requests through it one by one, each through its lease."""

    def __init__(self, cfg: ReplayConfig, shared: StorageBackend | None = None) -> None:
        """`shared`: a store other replayers use too (a fleet's), used in place of opening
        `cfg.cache.storage_url` and left open by close()."""
        for mod in MODEL_MODULES:
            importlib.import_module(mod)
        self.cfg = cfg
        self.model = REPLAY_MODELS.create(cfg.model, cfg)
        cc = cfg.cache
        self._owns_storage = shared is None
        self.storage = shared
        if shared is None and cc.storage_url:
            self.storage = open_storage(cc.storage_url, self.model.page_nbytes)
        host = PageAllocator(cc.host_pages) if cc.host_pages else None
        self.now = 0.0  # the step clock of a virtual-time model (seconds)
        self.cache = HiCache(
            cc,
            PageAllocator(cc.device_pages),
            host,
            self.model.mover(self.storage, self.clock),
            has_storage=self.storage is not None,
            page_nbytes=self.model.page_nbytes,
        )
        self.keys = KeyMapper(Namespace(page_size=cc.page_size), TokenMapper(cfg.vocab_size))
        self.uncached = 0  # requests whose pages did not fit in device memory

    def clock(self) -> float:
        return self.now if self.model.virtual_time else time.monotonic()

    def _tick(self) -> None:
        """One scheduler step of waiting: apply what finished, let time pass."""
        self.cache.step()
        if self.model.virtual_time:
            self.now += self.cfg.step_s
        else:
            time.sleep(0.0002)

    def serve(self, req: TraceRequest) -> tuple[Outcome, list[int], list[int]]:
        """Run one request; returns its outcome, hittable keys and the keys it leaves cached."""
        page, cache = self.cfg.page_size, self.cache
        keys = self.keys.keys(req)
        ins = self.keys.output_keys(req, keys)
        lease = Lease(cache, ins, req.input_length, len(ins), page)
        start = self.clock()
        while not lease.advance(self.clock(), can_schedule=True):
            if self.clock() - start > self.cfg.max_wait_s:
                raise TimeoutError(
                    f"request {req.rid}: storage probe/prefetch unfinished after "
                    f"{self.cfg.max_wait_s} s"
                )
            self._tick()
        waited = self.clock() - start
        while not lease.admit() and lease.can_ever_fit and len(cache.queues):
            self._tick()  # pages being demoted or copied free up once their copies land
        if lease.state is LeaseState.ADMITTED:
            self.model.prefill(req, lease.hit_tokens, lease.page_table, lease.load)
            lease.commit(len(ins) * page)
        else:  # nothing else runs here, so waiting cannot free device memory: serve it uncached
            self.uncached += 1
        lease.release()
        cache.drain()
        h = lease.hits
        out = Outcome(
            req.rid,
            req.arrival_s,
            req.input_length,
            h.device * page,
            h.host * page,
            h.storage * page,
            storage_wait_s=waited,
        )
        return out, ins[: lease.match_pages], ins

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
        if self.storage is not None and self._owns_storage:
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

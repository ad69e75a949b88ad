"""Compose an Engine from the per-layer configs: model, pools, mover, storage, cache."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.hicache import HiCache
from kvstrata.cache.keys import Namespace
from kvstrata.cache.ops import PageMover
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Agree, DecisionSink, Engine
from kvstrata.engine.kv_manager import KVManager
from kvstrata.engine.mtp_speculator import MTPSpeculator
from kvstrata.engine.scheduler import BatchLimit
from kvstrata.engine.speculative import Speculator
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool, HostPool
from kvstrata.memory.transfer import WHOLE, RankShare, TensorMover
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM
from kvstrata.model.draft import load_draft
from kvstrata.model.mtp import NEXTN, is_head_draft, load_head
from kvstrata.model.nextn import load_nextn
from kvstrata.model.page_state import state_layers
from kvstrata.storage.base import StorageConfig
from kvstrata.storage.units import PagePart, open_unit_storage


@dataclass
class Built:
    """An engine and the parts it owns (closed together), on one rank or on each of many."""

    engine: Engine
    mover: TensorMover | None
    closers: list[Callable[[], None]] = field(default_factory=list)
    """Closed after the drain, before the mover (a rank's decision log)."""

    def close(self, drain: bool = True) -> None:
        """drain: every pending op lands first (agreed under ranks; off when the ranks may be
        in different collectives, as after a failure)."""
        if drain:
            self.engine.drain()
        for close in self.closers:
            close()
        if self.mover is not None:
            self.mover.close()
            if self.mover.storage is not None:
                self.mover.storage.close()


def resolve_model_path(config: EngineConfig) -> Path:
    """The checkpoint to serve: --model, or SmolLM2 converted once from its GGUF."""
    if config.model:
        return Path(config.model)
    from kvstrata.model.smollm2 import ensure_smollm2

    return ensure_smollm2(config.model_cache_dir or None)


class Placement(Protocol):
    """Where one rank's part of the model and of every page lives, and what its cache is made
    of: OneRank holds all of both; each of tp x cp x pp ranks holds its part
    (kvstrata.ranks.rank_engine.RankEngine)."""

    def place(
        self, model: DecoderLM, shape: KVShape, spec: Speculator | None, pages: int
    ) -> tuple[Any, DevicePool]:
        """The model this rank runs (forward-compatible with the whole one) and its device pool
        of `pages` pages, each holding this rank's part of a page (`shape`: the whole page)."""
        ...

    def cache_parts(
        self, pool: DevicePool, cache_cfg: CacheConfig, storage_cfg: StorageConfig | None
    ) -> CacheParts:
        """The pools and mover of this rank's cache over `pool` (a tiered cache)."""
        ...

    def clock(self) -> float:
        """The decision clock (under ranks the agreed one)."""
        ...

    def limit(self, pool: DevicePool) -> BatchLimit | None:
        """A batch budget term beyond the token count (CP: the gather's scratch bytes)."""
        ...


class OneRank:
    """The N=1 placement: the whole model and every whole page on this rank."""

    def place(
        self, model: DecoderLM, shape: KVShape, spec: Speculator | None, pages: int
    ) -> tuple[Any, DevicePool]:
        return model, DevicePool(shape, pages)

    def cache_parts(
        self, pool: DevicePool, cache_cfg: CacheConfig, storage_cfg: StorageConfig | None
    ) -> CacheParts:
        """The device pool with its host pool (if any) and storage backend (if any), and their
        mover: the whole of every page."""
        shape = pool.shape
        whole = PagePart(shape, (0, shape.num_layers), (0, shape.num_kv_heads))
        return open_cache_parts(pool, whole, cache_cfg, storage_cfg)

    def clock(self) -> float:
        return time.monotonic()

    def limit(self, pool: DevicePool) -> BatchLimit | None:
        return None


def build_engine(
    config: EngineConfig,
    cache_cfg: CacheConfig,
    storage_cfg: StorageConfig | None = None,
    model: DecoderLM | None = None,
    agree: Agree | None = None,
    tenant: str = "",
    decisions: DecisionSink | None = None,
    placement: Placement | None = None,
) -> Built:
    """Everything a rank needs to serve, on one rank (placement None: OneRank) or on each of
    many; a loaded `model` (the whole one) may be shared between builds."""
    if config.threads and placement is None:  # a rank keeps the threads its launcher set
        torch.set_num_threads(config.threads)
    place = placement or OneRank()
    if model is None:
        model = load_model(
            resolve_model_path(config), dtype=config.dtype, prepack=config.prepack_weights
        )
    shape = model.kv_shape(cache_cfg.page_size)
    spec, fingerprint = None, model.fingerprint
    if config.spec_draft:
        spec, shape, fingerprint = build_speculator(config, model, shape)
    runs, pool = place.place(model, shape, spec, cache_cfg.device_pages)
    ns = Namespace(
        fingerprint,
        shape.dtype,
        tenant_salt=tenant,
        page_size=cache_cfg.page_size,
        kv_layout=shape.layout,
    )
    parts = CacheParts(pool)
    if cache_cfg.prefix_cache:
        parts = place.cache_parts(pool, cache_cfg, storage_cfg)
    limit = place.limit(pool)

    def make_engine(cache: HiCache | None, kv: KVManager) -> Engine:
        args = (runs, pool, cache, kv, config, agree, place.clock)
        return Engine(*args, decisions=decisions, speculator=spec, limit=limit)

    engine = assemble(config, cache_cfg, parts, ns, model.vocab_size, make_engine)
    return Built(engine, parts.mover)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CacheParts:
    """What one rank's cache is made of: its device pool, optional host pool, and the mover over
    them (None: no cache). A single rank and a parallel rank differ only in how these are made."""

    pool: DevicePool
    host: HostPool | None = None
    mover: PageMover | None = None
    has_storage: bool = False


def open_cache_parts(
    pool: DevicePool,
    part: PagePart,
    cache_cfg: CacheConfig,
    storage_cfg: StorageConfig | None,
    share: RankShare = WHOLE,
    commit_on_put: bool = True,
    crash_after_units: int = 0,
) -> CacheParts:
    """One rank's cache parts over its device `pool` of `part` of every page (one rank: the
    whole page): a host pool sharded like the device pool, the storage in the topology-free unit
    layout every parallel layout reads and writes too, and the mover of this rank's `share`.
    commit_on_put: False where the ranks agree a backup before its pages become visible."""
    host = None
    if cache_cfg.host_pages:
        host = HostPool(part.shape, cache_cfg.host_pages, n_shards=pool.n_shards, rank=pool.rank)
    storage = None
    if cache_cfg.storage_url:
        storage = open_unit_storage(
            cache_cfg.storage_url,
            part,
            storage_cfg,
            commit_on_put,
            crash_after_units=crash_after_units,
        )
    threads = storage_cfg.read_threads if storage_cfg is not None else StorageConfig().read_threads
    mover = TensorMover(pool, host, storage, share, threads)
    return CacheParts(pool, host, mover, storage is not None)


def assemble(
    config: EngineConfig,
    cache_cfg: CacheConfig,
    parts: CacheParts,
    ns: Namespace,
    vocab_size: int,
    make_engine: Callable[[HiCache | None, KVManager], Engine],
) -> Engine:
    """The one place an engine is put together: cache over the parts, KV manager, engine."""
    cache = None
    if parts.mover is not None:
        cache = HiCache(
            cache_cfg,
            parts.pool.allocator,
            parts.host.allocator if parts.host else None,
            parts.mover,
            has_storage=parts.has_storage,
            page_nbytes=parts.pool.shape.page_nbytes,
        )
    kv = KVManager(cache, parts.pool.allocator, ns, vocab_size)
    return make_engine(cache, kv)


def build_speculator(
    config: EngineConfig, model: DecoderLM, shape: KVShape
) -> tuple[Speculator, KVShape, str]:
    """The draft, the page shape with its layers packed after the target's, and the namespace
    fingerprint naming both models (KV made with one draft is never served to another)."""
    from kvstrata.model.smollm2 import default_cache_dir

    target_layers = shape.num_layers
    cache_dir = Path(config.model_cache_dir) if config.model_cache_dir else default_cache_dir()
    if is_head_draft(config.spec_draft):
        # one NextN layer: one tail layer per page, then the target-state layers
        if config.spec_draft == NEXTN:
            head = load_nextn(model, resolve_model_path(config), cache_dir)
        else:
            head = load_head(config.spec_draft, model)
        n_state = state_layers(shape, head.eh_proj.out_features)
        mtp = MTPSpeculator(head, target_layers, config.spec_tokens, shape.page_size, n_state)
        shape = dataclasses.replace(shape, num_layers=target_layers + 1 + n_state)
        return mtp, shape, f"{model.fingerprint}+{mtp.fingerprint}"
    draft = load_draft(config.spec_draft, model, cache_dir)
    shape = dataclasses.replace(shape, num_layers=target_layers + draft.spec.num_layers)
    spec = Speculator(draft, target_layers, config.spec_tokens)
    return spec, shape, f"{model.fingerprint}+{spec.fingerprint}"

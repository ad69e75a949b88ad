"""Run the engine on tp x cp x pp local ranks with one logical cache everywhere.

Every rank loads the model, keeps its part (kvstrata.model_parallel.tp / pp / cp), builds pools
holding its part of every page and the mover of its share (kvstrata.memory.transfer: RankShare),
the same HiCache and the same scheduler. Per step:
  1. rank 0 broadcasts (new requests, its clock, stop) with broadcast_object_list: inputs and
     time are the same on every rank, so admission and prefetch budgets decide alike;
  2. Engine.step(): its `agree` hook is StepConsensus (kvstrata.ranks.consensus), one
     all_reduce(MIN) over the cache's progress vector (+ step and, in live mode,
     decision-digest checks);
  3. the forward (tp all_reduces / pp sends / cp gathers), identical tokens on every rank.
The tree is never sent: each rank applies exactly the agreed events. A per-step tree digest
(optional) is logged in the DecisionLog and returned, so tests compare trees step by step.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import xxhash

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.hicache import HiCache
from kvstrata.cache.radix import Node
from kvstrata.configtools import doc
from kvstrata.engine.build import (
    CacheParts,
    build_engine,
    open_cache_parts,
    resolve_model_path,
)
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.feed import StaticWorkload, Workload, drive
from kvstrata.engine.request import Request
from kvstrata.engine.speculative import Speculator
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool
from kvstrata.memory.transfer import RankShare, TensorMover
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM
from kvstrata.model_parallel.cp import CPModel
from kvstrata.model_parallel.pp import PipelineStage, stage_bounds
from kvstrata.model_parallel.tp import head_range, shard_tp
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.consensus import StepConsensus, StepFields
from kvstrata.ranks.decision_log import MASK63, DecisionLog, config_digest
from kvstrata.ranks.group import (
    RankContext,
    heartbeat,
    run_ranks,
    verify_same,
)
from kvstrata.ranks.report import PageWatch, rank_result
from kvstrata.ranks.scratch_budget import ScratchBudget
from kvstrata.ranks.spec import place_speculator
from kvstrata.storage.base import StorageConfig
from kvstrata.storage.mooncake_client import used_in_this_process
from kvstrata.storage.units import PagePart


@dataclass(frozen=True)
class RankOptions:
    """Knobs of a distributed run beyond the engine/cache/dist configs (testing, diagnostics)."""

    delay: int = doc(0, "testing: each op looks unfinished for random 0..delay polls per rank")
    seed: int = doc(0, "seed of the injected delays (each rank draws its own stream)")
    demote_when_idle: bool = doc(
        False, "testing: push every cached page device -> host between turns"
    )
    tree_digests: bool = doc(False, "digest the radix tree every step (returned and logged)")
    cp_scratch_bytes: int = doc(0, "cp: most bytes both gather buffer pairs may take; 0 = any")
    report_host_pages: bool = doc(False, "testing: report each owned cached host page's bytes")
    report_pages: bool = doc(False, "testing: report owned restored and cached device page bytes")
    crash_rank: int = doc(-1, "testing: this global rank dies mid-backup (see crash_after_units)")
    crash_after_units: int = doc(
        0, "testing: crash_rank exits after writing this many storage units"
    )

    def __post_init__(self) -> None:
        for name in ("delay", "cp_scratch_bytes", "crash_after_units"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def tree_digest(cache: HiCache) -> int:
    """63-bit digest of the whole tree: keys, every tier's page ids, locks and pins (copies'
    and clients'), children by key."""
    h = xxhash.xxh3_64()
    stack: list[tuple[int, Node]] = [(0, cache.tree.root)]
    while stack:
        depth, node = stack.pop()
        rec = (
            depth, node.keys, node.device, node.host, node.in_storage, node.lock_ref, node.pins,
            node.keep,
        )  # fmt: skip
        h.update(repr(rec).encode())
        stack.extend((depth + 1, node.children[k]) for k in sorted(node.children, reverse=True))
    return h.intdigest() & MASK63


@dataclass
class RankParts:
    model: Any  # DecoderLM | PipelineStage | CPModel: forward-compatible with the Engine
    part: PagePart
    stage: PipelineStage | None = None
    target_layers: int = 0  # the target's layers in this rank's pools (a draft's follow them)


def model_part(ctx: RankContext, full: Any, shape: KVShape) -> RankParts:
    """This rank's slice of the model and which part of every page (`shape`: the whole page,
    a draft's tail layers included) it holds: the last stage holds the draft's layers."""
    cfg = ctx.config
    spec = full.spec
    tp_model = shard_tp(full, cfg.tp, ctx.tp_rank, ctx.tp_group)
    model: Any = tp_model
    layers = (0, shape.num_layers)
    stage = None
    if cfg.pp > 1:
        bounds = stage_bounds(spec.num_layers, cfg.pp)
        last = ctx.pp_rank == cfg.pp - 1
        layers = (bounds[ctx.pp_rank], shape.num_layers if last else bounds[ctx.pp_rank + 1])
        ranks = next(g for g in ctx.layout.groups("pp") if ctx.rank in g)
        model = stage = PipelineStage(tp_model, cfg.pp, ctx.pp_rank, ranks, ctx.pp_group)
    if cfg.cp > 1:
        model = CPModel(tp_model, cfg.cp, ctx.cp_rank, ctx.cp_group, stage)
    # a latent page has no head axis: every tp rank holds all of it
    heads = (0, 1) if shape.layout == "mla" else head_range(spec.num_kv_heads, cfg.tp, ctx.tp_rank)
    n = stage.end - stage.first if stage is not None else spec.num_layers
    return RankParts(model, PagePart(shape, layers, heads), stage, n)


class RankEngine:
    """One rank's engine, cache and step agreement."""

    def __init__(
        self,
        ctx: RankContext,
        engine_cfg: EngineConfig,
        cache_cfg: CacheConfig,
        storage_cfg: StorageConfig | None,
        options: RankOptions,
        extra: StepFields | None = None,
    ) -> None:
        """extra: more fields of the step's one collective (a P/D worker's gate,
        kvstrata.pd.ranks: HandoffGate, PrefillGate)."""
        self.ctx, self.options, self.extra = ctx, options, extra
        self.now = 0.0
        full = load_model(engine_cfg.model, dtype=engine_cfg.dtype)
        # paths may differ per node; the weights fingerprint is the model's identity
        check = {**dataclasses.asdict(engine_cfg), **dataclasses.asdict(cache_cfg)}
        for local_only in ("model", "model_cache_dir", "threads"):
            check.pop(local_only)
        verify_same("config", {**check, "fingerprint": full.fingerprint})
        self.log = DecisionLog.from_config(ctx.config, ctx.rank, ctx.run_id, config_digest(check))
        self.calls = 0
        self.digests: list[int] = []
        self.part: PagePart  # this rank's part of every page, and its pool of them (`place`)
        self.pool: DevicePool
        # the same builder as one rank's; this rank adds its placement, the step agreement and
        # the decision log (closed with the engine)
        self.built = build_engine(
            engine_cfg, cache_cfg, storage_cfg, full, self.agree, decisions=self, placement=self
        )
        self.built.closers.append(self.log.close)
        self.engine = self.built.engine
        self.mover: TensorMover | None = self.built.mover
        self.pages = PageWatch(self.pool) if options.report_pages else None
        self.cache = self.engine.cache
        self.consensus: StepConsensus | None = None
        if self.cache is not None:
            n = len(self.cache.local_progress())
            self.fields = [f"p{i}" for i in range(n)]
            more = (list(extra.min_fields), list(extra.max_fields)) if extra else ([], [])
            self.consensus = StepConsensus(
                self.fields + more[0], more[1], live_check=ctx.config.live_check
            )

    def clock(self) -> float:
        """The agreed clock: rank 0's time, broadcast with each step's inputs."""
        return self.now

    def set_clock(self, now: float) -> None:
        self.now = now

    # ---- Placement for build_engine: this rank's part of the model and of every page ----------
    def place(
        self, model: DecoderLM, shape: KVShape, spec: Speculator | None, pages: int
    ) -> tuple[Any, DevicePool]:
        """This rank's slice of the model (the draft's layers on the last stage) and its pool
        of its part of every page; device pages sharded over cp."""
        ctx = self.ctx
        rp = model_part(ctx, model, shape)
        if spec is not None:
            place_speculator(spec, ctx, rp.stage, rp.target_layers)
        self.part = rp.part
        self.pool = DevicePool(rp.part.shape, pages, n_shards=ctx.config.cp, rank=ctx.cp_rank)
        return rp.model, self.pool

    def limit(self, pool: DevicePool) -> ScratchBudget | None:
        cp = self.ctx.config.cp
        return ScratchBudget(pool, self.options.cp_scratch_bytes) if cp > 1 else None

    def cache_parts(
        self, pool: DevicePool, ccfg: CacheConfig, scfg: StorageConfig | None
    ) -> CacheParts:
        ctx, o = self.ctx, self.options
        crash = o.crash_after_units if ctx.rank == o.crash_rank else 0
        share = RankShare(
            # tp ranks holding the same latent units: only tp rank 0 writes them, all read them
            unit_writer=self.part.shape.layout != "mla" or ctx.tp_rank == 0,
            commit_writer=ctx.tp_rank == 0 and ctx.pp_rank == 0,  # commits its cp rank's pages
            delay=(o.delay, o.seed * 1000 + ctx.rank) if o.delay else None,
        )
        # host pages sharded like device pages: this rank stores only the host ids it owns
        # (id % cp == cp_rank); a backup becomes visible once every rank wrote it (agreed)
        return open_cache_parts(
            pool, self.part, ccfg, scfg, share, commit_on_put=False, crash_after_units=crash
        )

    # ---- the step agreement --------------------------------------------------------------------
    def agree(self, local: list[int]) -> list[int]:
        """The Engine's hook: ONE all_reduce(MIN) (+ step / live digest checks) per call."""
        assert self.consensus is not None
        counts = dict(zip(self.fields, local, strict=True))
        if self.extra is not None:
            counts.update(self.extra.local())
        agreed = self.consensus.agree(self.calls, counts, self.log)
        if self.extra is not None:
            self.extra.agreed(agreed.values)
        self.calls += 1  # same count on every rank: engine steps and agreed drains alike
        return [agreed[f] for f in self.fields]

    # ---- DecisionSink for the Engine: its records, plus the tree digest at each step's end --
    def begin_step(self, step: int) -> None:
        self.log.begin_step(step)

    def should_skip(self, step: int | None = None) -> bool:
        return self.log.should_skip(step)

    def record(self, kind: str, **payload: Any) -> bool:
        return self.log.record(kind, **payload)  # the engine logs scalars and flat lists

    def end_step(self, step: int | None = None) -> int:
        cfg = self.ctx.config
        # Every step in live mode too: a skipped decision whose own record is not in the step
        # (e.g. a step with no other record) shows only in the tree; found later, the ranks are
        # already in different collectives. Cost measured: +0.27 ms on an 11 ms tiny-model step.
        if self.cache is not None and (
            self.options.tree_digests or cfg.live_check or cfg.consensus_log
        ):
            d = tree_digest(self.cache)
            self.digests.append(d)
            self.log.record("tree", d=d)
        return self.log.end_step(step)

    def drain(self) -> None:
        """Apply every pending op, agreed (the engine's drain: every rank loops alike)."""
        self.engine.drain()

    def demote_all(self) -> None:
        """Push every cached page out of device memory (to host memory where there is room),
        agreed."""
        cache = self.cache
        if cache is None:
            return
        self.drain()
        held = cache.alloc_device(cache.tiers.device.num_free) or []
        cache.tiers.evict_device(self.pool.capacity)
        self.drain()
        cache.free_device(held)

    def close(self, drain: bool = True) -> None:
        self.built.close(drain)


class AgreedFeed:
    """Rank 0's workload, broadcast each step with rank 0's clock: every rank gets the same new
    requests at the same agreed time (the clock prefetch budgets read)."""

    def __init__(self, workload: Workload, rank: int, engine: RankEngine) -> None:
        self.workload, self.rank, self.engine = workload, rank, engine

    def poll(self, finished: list[Request]) -> list[Request] | None:
        msg: list[Any] = [None, 0.0]
        if self.rank == 0:
            msg = [self.workload.poll(finished), time.monotonic()]
        dist.broadcast_object_list(msg, src=0)
        self.engine.now = msg[1]
        return msg[0]


def rank_loop(
    ctx: RankContext,
    engine_cfg: EngineConfig,
    cache_cfg: CacheConfig,
    storage_cfg: StorageConfig | None,
    workload: Workload,
    options: RankOptions,
) -> dict[str, Any]:
    """Body of one rank: same inputs, same steps, same tree as every other rank."""
    heartbeat()  # from here on the parent names this rank hung after timeout_s of silence
    re = RankEngine(ctx, engine_cfg, cache_cfg, storage_cfg, options)
    eng = re.engine
    done: list[Request] = []

    def before_step() -> None:
        heartbeat()
        if options.demote_when_idle and not eng.has_work():
            re.demote_all()

    try:
        for result in drive(eng, AgreedFeed(workload, ctx.rank, re), before_step):
            done += result.ended
            if re.pages is not None:
                re.pages.after_step(result)
            if options.tree_digests:
                eng.check_integrity()
    except BaseException:
        re.close(drain=False)  # no collectives: the other ranks may be elsewhere
        raise
    re.close()
    return rank_result(re, done)


def run_distributed(
    engine_cfg: EngineConfig,
    cache_cfg: CacheConfig,
    dist_cfg: DistConfig,
    requests: list[Request] | Workload,
    storage_cfg: StorageConfig | None = None,
    options: RankOptions | None = None,
    timeout_s: float = float("inf"),
) -> list[dict[str, Any]]:
    """Spawn dist_cfg.world_size local ranks (tp x cp x pp) and serve `requests` on them.

    Returns one report per rank (rank order): outputs / logits / hits per request id, per-step
    tree digests (with options.tree_digests), the rank's share of cached device pages.
    Raises RankFailure naming a rank that raised, died or hung: every rank beats once per step,
    so a silent rank is named within dist_cfg.timeout_s (+ grace), however long the run.
    """
    engine_cfg = dataclasses.replace(engine_cfg, model=str(resolve_model_path(engine_cfg)))
    workload = StaticWorkload(list(requests)) if isinstance(requests, list) else requests
    args = (engine_cfg, cache_cfg, storage_cfg, workload, options or RankOptions())
    # a Mooncake client set up in this process makes forked ranks hang in theirs: spawn then
    start = "spawn" if used_in_this_process() else None
    return run_ranks(rank_loop, dist_cfg, args=args, start_method=start, timeout_s=timeout_s)

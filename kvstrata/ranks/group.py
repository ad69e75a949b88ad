"""torch.distributed process groups: rank layout (tp x cp x pp), init/teardown, local spawning
(what a failed rank reports, and how the parent watches them: ranks/failures.py).

Rank order puts tensor parallel fastest, then context parallel, then pipeline stage:
rank = (pp_idx * cp + cp_idx) * tp + tp_idx. The tp group of a rank is the ranks that share its
(pp_idx, cp_idx); likewise for cp and pp. The layout is a pure function of the config, so every
rank builds the same subgroups in the same order (torch requires new_group to be called by all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from kvstrata.local_ports import reserved_port
from kvstrata.parent_watch import exit_with_parent
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.decision_log import new_run_id
from kvstrata.ranks.failures import (
    RankFailure,
    collect_reports,
    describe_exception,
    first_failure,
    reap,
)

__all__ = ["RankFailure"]  # raised by run_ranks; importers take it from here


@dataclass(frozen=True)
class RankLayout:
    """Where each global rank sits in the tp x cp x pp grid (pure, no torch state)."""

    tp: int
    cp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_idx, cp_idx, tp_idx) of `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank // (self.cp * self.tp), (rank // self.tp) % self.cp, rank % self.tp

    def rank_of(self, pp_idx: int, cp_idx: int, tp_idx: int) -> int:
        return (pp_idx * self.cp + cp_idx) * self.tp + tp_idx

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along `axis` ("tp", "cp" or "pp"): each a sorted list of global ranks."""
        sizes = {"pp": self.pp, "cp": self.cp, "tp": self.tp}
        if axis not in sizes:
            raise ValueError(f"axis must be tp, cp or pp, got {axis!r}")
        out: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            pp_idx, cp_idx, tp_idx = self.coords(rank)
            idx = {"pp": pp_idx, "cp": cp_idx, "tp": tp_idx}
            fixed = tuple(v for k, v in idx.items() if k != axis)
            out.setdefault(fixed, []).append(rank)
        return list(out.values())


@dataclass
class RankContext:
    """One rank's view: its global rank, coordinates and subgroups (None = WORLD)."""

    rank: int
    world_size: int
    backend: str
    config: DistConfig
    layout: RankLayout
    tp_group: Any = None
    cp_group: Any = None
    pp_group: Any = None
    run_id: str = ""  # rank 0's, agreed at init: every rank's decision log carries it

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def cp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


_FAILURE_GRACE_S = 3.0
COLLECTIVE_FRACTION = 0.6
"""A collective gives up after 0.6 x timeout_s, so that with the parent's grace (at most
0.1 x timeout_s) every rank is stopped and named within timeout_s of a rank dying or hanging."""


def grace_s(timeout_s: float) -> float:
    """How long the parent waits for the other ranks' reports once one rank has failed."""
    return min(_FAILURE_GRACE_S, 0.1 * timeout_s)


_HEARTBEAT: tuple[Any, int] | None = None  # (shared array of beat times, this rank) in a child


def heartbeat() -> None:
    """Called by a rank's loop once per step: the parent names a rank silent for longer than
    timeout_s as hung (a rank blocked in a collective with it times out and reports first)."""
    if _HEARTBEAT is not None:  # 0.0 until a rank's first beat: only beating ranks are watched
        beats, rank = _HEARTBEAT
        beats[rank] = time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable across ranks


def resolve_backend(name: str) -> str:
    """auto -> nccl when CUDA is present, else gloo."""
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which is not available; use gloo")
    return name


def _subgroup(layout: RankLayout, axis: str, rank: int) -> Any:
    """Create every group along `axis` (all ranks must call this alike); return rank's own."""
    mine: Any = None
    for ranks in layout.groups(axis):
        if len(ranks) == layout.world_size:
            group: Any = None  # the world group
        else:
            group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def init_ranks(config: DistConfig, rank: int | None = None) -> RankContext:
    """Join the process group. rank=None reads torchrun's environment (env://) at call time."""
    backend = resolve_backend(config.backend)
    timeout = timedelta(seconds=COLLECTIVE_FRACTION * config.timeout_s)
    world = config.world_size
    if rank is None:
        dist.init_process_group(backend, timeout=timeout)
        rank = dist.get_rank()
        if dist.get_world_size() != world:
            raise ValueError(f"world size {dist.get_world_size()} != tp*cp*pp = {world}")
    else:
        if config.master_port == 0:
            raise ValueError("master_port must be set (non-zero) when ranks are given explicitly")
        url = f"tcp://{config.master_addr}:{config.master_port}"
        dist.init_process_group(
            backend, init_method=url, rank=rank, world_size=world, timeout=timeout
        )
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    layout = RankLayout(config.tp, config.cp, config.pp)
    ctx = RankContext(rank, world, backend, config, layout)
    ctx.tp_group = _subgroup(layout, "tp", rank)
    ctx.cp_group = _subgroup(layout, "cp", rank)
    ctx.pp_group = _subgroup(layout, "pp", rank)
    msg = [new_run_id() if rank == 0 else None]
    dist.broadcast_object_list(msg, src=0)
    ctx.run_id = msg[0]
    return ctx


def teardown() -> None:
    """Leave the process group (safe to call when not initialised)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def verify_same(name: str, fields: Mapping[str, Any], group: Any = None) -> None:
    """Refuse to start when ranks were given different configs: the differing field is named."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(fields), group=group)
    for rank, other in enumerate(gathered):
        for key in sorted(set(other) | set(gathered[0])):
            if other.get(key) != gathered[0].get(key):
                raise ValueError(
                    f"{name}.{key} differs across ranks: rank 0 has {gathered[0].get(key)!r}, "
                    f"rank {rank} has {other.get(key)!r}"
                )


class RankStopped(KeyboardInterrupt):
    """SIGTERM in a working rank: unwinds it like Ctrl-C (its finally blocks clean up)."""


_REPORTED = False
"""Set just before a rank puts its result (or failure) in the queue: a SIGTERM from then on
(the parent ending ranks that are done) must not unwind the report or the teardown."""


def _stop_rank(signum: int, frame: Any) -> None:
    if _REPORTED:  # a stop that raced the report: the rank is ending by itself anyway
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise RankStopped()


ORPHAN_GRACE_S = 5.0
"""An orphaned rank unwinds (SIGTERM) and is ended this long after if it did not."""


def _rank_main(
    rank: int, config: DistConfig, fn: Callable[..., Any], args: tuple, q: Any, beats: Any
) -> None:
    """Body of one spawned rank: init, run fn(ctx, *args), report through the queue."""
    global _HEARTBEAT, _REPORTED
    _HEARTBEAT = (beats, rank)
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _stop_rank)  # while working: unwind, so no temp file is left
    # a rank whose parent died without stopping it (kill -9 of `serve --tp 2`) stops itself
    exit_with_parent(tmp.parent_process().pid, ORPHAN_GRACE_S)  # type: ignore[union-attr]
    try:
        ctx = init_ranks(config, rank)
        result = fn(ctx, *args)
        _REPORTED = True
        q.put((rank, True, result))
    except BaseException as exc:  # report everything: the parent names the rank
        _REPORTED = True
        q.put((rank, False, describe_exception(exc, COLLECTIVE_FRACTION * config.timeout_s)))
    finally:
        # Reported: from here a terminate() from the parent just ends the process, quietly.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        teardown()


def run_ranks(
    fn: Callable[..., Any],
    config: DistConfig,
    args: tuple = (),
    start_method: str | None = None,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Spawn config.world_size local ranks on master_addr, run fn(ctx, *args) on each.

    Returns the per-rank results in rank order. Raises RankFailure naming the first rank that
    raised, died or hung. `fork` is much cheaper than `spawn` (no re-import of torch) and is the
    default without CUDA; with CUDA (or on request) `spawn` is used, and fn must be importable.
    """
    with contextlib.ExitStack() as held:
        if config.master_port == 0:
            # held bound until the ranks are done, so no other process's free_port picks it
            # while rank 0 starts its store there (the store binds it anyway: SO_REUSEADDR); a
            # port merely found free could be taken first, and then rank 0 fails to listen
            # while the other ranks wait on the neighbour's socket until the timeout
            port = held.enter_context(reserved_port(config.master_addr))
            config = dataclasses.replace(config, master_port=port)
        return _spawn_and_collect(fn, config, args, start_method, timeout_s)


def _spawn_and_collect(
    fn: Callable[..., Any],
    config: DistConfig,
    args: tuple,
    start_method: str | None,
    timeout_s: float,
) -> list[Any]:
    """run_ranks once its master port is settled."""
    if start_method is None:
        start_method = "spawn" if resolve_backend(config.backend) == "nccl" else "fork"
    mp = tmp.get_context(start_method)
    q = mp.Queue()
    beats = mp.Array("d", config.world_size, lock=False)  # zeros: no beat yet
    procs = [
        mp.Process(target=_rank_main, args=(r, config, fn, args, q, beats))
        for r in range(config.world_size)
    ]
    for p in procs:
        p.start()
    grace = grace_s(config.timeout_s)
    hang_s = COLLECTIVE_FRACTION * config.timeout_s + grace  # its peers time out first
    reports: dict[int, tuple[bool, Any]] = {}
    try:
        reports = collect_reports(procs, q, time.monotonic() + timeout_s, beats, hang_s, grace)
    finally:  # also on Ctrl-C / SIGTERM in the parent (no reports): the ranks are stopped
        reap(procs, patient=bool(reports) and all(ok for ok, _ in reports.values()))
    failure = first_failure(reports)
    if failure is not None:
        raise failure
    return [reports[r][1] for r in range(config.world_size)]

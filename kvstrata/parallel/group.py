"""torch.distributed process groups: rank layout (tp x cp x pp), init/teardown, local spawning.

Rank order puts tensor parallel fastest, then context parallel, then pipeline stage:
rank = (pp_idx * cp + cp_idx) * tp + tp_idx. The tp group of a rank is the ranks that share its
(pp_idx, cp_idx); likewise for cp and pp. The layout is a pure function of the config, so every
rank builds the same subgroups in the same order (torch requires new_group to be called by all).
"""

from __future__ import annotations

import dataclasses
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from kvstrata.parallel.config import DistConfig


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
_DIED = "died"


class RankFailure(RuntimeError):
    """A spawned rank raised, died or hung; the message names the rank."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
    timeout = timedelta(seconds=config.timeout_s)
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


def _rank_main(rank: int, config: DistConfig, fn: Callable[..., Any], args: tuple, q: Any) -> None:
    """Body of one spawned rank: init, run fn(ctx, *args), report through the queue."""
    torch.set_num_threads(1)
    try:
        ctx = init_ranks(config, rank)
        result = fn(ctx, *args)
        q.put((rank, True, result))
    except BaseException as exc:  # report everything: the parent names the rank
        trace = "" if getattr(exc, "is_report", False) else f"\n{traceback.format_exc()}"
        q.put((rank, False, f"{type(exc).__name__}: {exc}{trace}"))
    finally:
        teardown()


def _collect(procs: list[Any], q: Any, deadline: float) -> dict[int, tuple[bool, Any]]:
    """Gather one report per rank. Once any rank has failed or exited without a report, the
    rest get a short grace (they may be stuck in a collective with it), then count as hung."""
    reports: dict[int, tuple[bool, Any]] = {}
    while len(reports) < len(procs):
        try:
            rank, ok, value = q.get(timeout=0.1)
            reports[rank] = (ok, value)
            if not ok:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
            continue
        except queue_mod.Empty:
            pass
        now = time.monotonic()
        if any(r not in reports and p.exitcode is not None for r, p in enumerate(procs)):
            # A report may still be in the pipe just after an exit: the grace covers that.
            deadline = min(deadline, now + _FAILURE_GRACE_S)
        if now > deadline:
            for rank, p in enumerate(procs):
                if p.exitcode is not None:
                    reason = f"{_DIED} (exit code {p.exitcode}) without a result"
                else:
                    reason = "did not finish before the timeout (hung?)"
                reports.setdefault(rank, (False, reason))
    return reports


def _first_failure(reports: dict[int, tuple[bool, Any]]) -> int | None:
    """The rank to blame: one that died, else one that raised, else one that hung."""
    failed = [r for r in sorted(reports) if not reports[r][0]]
    if not failed:
        return None
    died = [r for r in failed if str(reports[r][1]).startswith(_DIED)]
    raised = [r for r in failed if "(hung?)" not in str(reports[r][1])]
    return (died or raised or failed)[0]


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
    if config.master_port == 0:
        config = dataclasses.replace(config, master_port=free_port(config.master_addr))
    if start_method is None:
        start_method = "spawn" if resolve_backend(config.backend) == "nccl" else "fork"
    mp = tmp.get_context(start_method)
    q = mp.Queue()
    procs = [
        mp.Process(target=_rank_main, args=(r, config, fn, args, q))
        for r in range(config.world_size)
    ]
    for p in procs:
        p.start()
    try:
        reports = _collect(procs, q, time.monotonic() + timeout_s)
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
    first = _first_failure(reports)
    if first is not None:
        failed = [r for r in sorted(reports) if not reports[r][0]]
        raise RankFailure(f"rank {first} failed: {reports[first][1]} (failed ranks: {failed})")
    return [reports[r][1] for r in range(config.world_size)]

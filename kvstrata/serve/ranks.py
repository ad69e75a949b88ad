"""Serving on tp x cp x pp local ranks (`DistRanks`, the N > 1 ranks of a LoopFront): rank 0 takes
the requests, every rank runs the same steps.

The HTTP process is no rank: it spawns the ranks (kvstrata.ranks.group.run_ranks, fork) from a
thread and talks to rank 0 through two multiprocessing queues. Each step rank 0 drains its inbox
(typed step inputs: new requests, aborts, calls, stop) and broadcasts them with its clock and
whether to step, so every rank runs the same step loop (kvstrata/serve/step_loop.py) alike;
samplers are rebuilt on each rank from the request's SamplingParams and seed, so every rank draws
the same token. Rank 0 sends tokens and endings back; a dispatcher thread in the HTTP process
hands them to the requests' streams.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.step_io import Inbox, Ready, StepInputs, StepOutput
from kvstrata.pd.config import PDConfig
from kvstrata.pd.layout import layout_of
from kvstrata.pd.ranks import RankPD
from kvstrata.pd.reports import REPORTS, PDReport
from kvstrata.pd.worker import PDWorker
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.group import RankContext
from kvstrata.ranks.rank_engine import RankEngine, RankOptions
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.events import KVEventPublisher, rank0_events
from kvstrata.serve.loop import LoopFront
from kvstrata.serve.step_loop import IDLE_WAIT_S, FanOut, StepLoop, run_steps
from kvstrata.storage.base import StorageConfig

STATS_EVERY_S = 0.5  # rank 0 reports pools, counters and agreement latencies this often
FOREVER_S = 10 * 365 * 86400.0  # run_ranks' bound on the whole run: a server runs until stopped


RankOutput = StepOutput | Ready | PDReport
"""What rank 0 sends the HTTP process: the step loop's outputs, that every rank is up, and a
P/D worker's reports."""


class Outbox(Protocol):
    """Rank 0 -> the HTTP process (a queue.Queue under torchrun, else a process queue)."""

    def put(self, item: RankOutput) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> RankOutput: ...


def _gather(rank0: bool) -> Callable[[tuple[bool, Any]], list[tuple[bool, Any]] | None]:
    """Every rank's (ok, result) of a call, on rank 0 (one gather per call, every rank)."""

    def gather(mine: tuple[bool, Any]) -> list[tuple[bool, Any]] | None:
        gathered: list[Any] = [None] * dist.get_world_size() if rank0 else []
        dist.gather_object(mine, gathered if rank0 else None, dst=0)
        return gathered if rank0 else None

    return gather


def serve_rank_loop(
    ctx: RankContext,
    engine_cfg: EngineConfig,
    cache_cfg: CacheConfig,
    storage_cfg: StorageConfig | None,
    inbox: Inbox,
    outbox: Outbox | None,
    serve_cfg: ServeConfig | None = None,
    pd_cfg: PDConfig | None = None,
) -> dict[str, Any]:
    if threading.current_thread() is threading.main_thread():  # (torchrun's rank 0: a thread)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process decides when ranks stop
    out = outbox if ctx.rank == 0 else None
    pd = None
    if serve_cfg is not None and serve_cfg.role in ("prefill", "decode"):
        report = out.put if out is not None else None  # rank 0 reports the worker's counters
        slots = engine_cfg.max_running  # a slot of the step collective per request in flight
        pd = RankPD(serve_cfg.role, pd_cfg or PDConfig(), ctx.rank, report, inbox, slots)
    gate = pd.gate if pd is not None else None
    re = RankEngine(ctx, engine_cfg, cache_cfg, storage_cfg, RankOptions(), extra=gate)
    eng = re.engine
    events = rank0_events(serve_cfg, cache_cfg.page_size, eng) if out is not None else None
    try:
        if pd is not None:
            c = ctx.config
            layout = layout_of(eng, c.tp, c.cp, c.pp, shape=re.part.full, rank=ctx.rank)
            pd.attach(eng, layout, (ctx.cp_rank, ctx.cp_group), _all_endpoints)
        _serve_steps(re, inbox, out, events)
    finally:
        if events is not None:
            events.close()
        if pd is not None:
            pd.close()
    return {"rank": ctx.rank, "steps": eng.steps}


def _broadcast(msg: StepInputs | None) -> StepInputs:
    """Rank 0's step inputs, on every rank (one broadcast per step)."""
    box: list[Any] = [msg]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_endpoints(mine: str) -> list[str]:
    """Every rank's transfer endpoint, rank order (one all_gather, every rank)."""
    endpoints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(endpoints, mine)
    return endpoints


def _serve_steps(
    re: RankEngine,
    inbox: Inbox,
    out: Outbox | None,
    events: KVEventPublisher | None,
) -> None:
    """Every rank: the same step loop over the inputs rank 0 broadcasts."""
    eng, rank0 = re.engine, out is not None
    fan = FanOut(_broadcast, _gather(rank0), re.set_clock)
    steps = StepLoop(eng, out.put if out else None, fan, events, STATS_EVERY_S)
    if out is not None:
        eng.agree = steps.timed(eng.agree)
        out.put(Ready())
    run_steps(steps, inbox if rank0 else None)
    eng.check_integrity()
    re.close()  # drains pending cache ops (storage backups), agreed
    eng.check_integrity()
    if events is not None:  # the drained state (new storage copies) is reported too
        events.after_step(eng.cache, eng.between_steps())


class DistRanks:
    """N > 1: the step loop over ranks in child processes (see the module docstring), or, under
    torchrun (torchrun=True), over this process as rank 0, stepping in a thread of it. Rank 0
    broadcasts the inputs and gathers the calls' results; its outputs come back over a queue,
    which a dispatcher thread hands to the front."""

    fatal_stop = True  # a rank that died, hung or diverged stops them all, for good

    def __init__(
        self,
        configs: tuple[EngineConfig, CacheConfig, StorageConfig],
        dist_cfg: DistConfig,
        serve_cfg: ServeConfig | None = None,
        torchrun: bool = False,
        pd: PDWorker | None = None,
    ) -> None:
        """pd: the HTTP side of a P/D worker, which rank 0 tells its layout and endpoints and
        forwards its hand-off counters to (typed reports, kvstrata/pd/reports.py)."""
        import torch.multiprocessing as tmp

        self.torchrun = torchrun
        if torchrun:  # rank 0 is a thread of this process: plain thread-safe queues
            self.inbox: Inbox = queue.Queue()
            self.outbox: Outbox = queue.Queue()
        else:
            mp = tmp.get_context("fork")
            self.inbox, self.outbox = mp.Queue(), mp.Queue()
        self.configs, self.dist_cfg = configs, dist_cfg
        self.serve_cfg, self.pd = serve_cfg, pd
        self._front: LoopFront | None = None
        self._done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvstrata-ranks", daemon=True)
        self._dispatch = threading.Thread(
            target=self._dispatcher, name="kvstrata-dispatch", daemon=True
        )

    def start(self, front: LoopFront) -> None:
        self._front = front
        self.thread.start()
        self._dispatch.start()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        self._done.set()
        self._dispatch.join(5.0)

    def local_engine(self) -> Engine | None:
        return None  # it runs in the rank processes

    # ---- threads of the HTTP process -------------------------------------------------------------
    def _run(self) -> None:
        from kvstrata.ranks.group import init_ranks, run_ranks, teardown

        front = self._front
        assert front is not None
        pd_cfg = self.pd.cfg if self.pd is not None else None
        args = (*self.configs, self.inbox, self.outbox, self.serve_cfg, pd_cfg)
        try:
            if self.torchrun:
                ctx = init_ranks(self.dist_cfg)  # env://: the other ranks are serve_follower
                try:
                    serve_rank_loop(ctx, *args)
                finally:
                    teardown()
            else:
                run_ranks(
                    serve_rank_loop, self.dist_cfg, args, start_method="fork", timeout_s=FOREVER_S
                )
        except Exception as exc:  # noqa: BLE001 - reported by /health and on stderr
            front.failed = f"{type(exc).__name__}: {exc}"
            print(f"kvstrata serve: ranks stopped: {front.failed}", file=sys.stderr)
        finally:
            front.ready.set()
            if front.failed:
                front.fail_all(f"the ranks stopped: {front.failed}")

    def _dispatcher(self) -> None:
        front = self._front
        assert front is not None
        while not self._done.is_set():
            try:
                msg = self.outbox.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                continue
            if isinstance(msg, Ready):
                front.ready.set()
            elif isinstance(msg, REPORTS):  # a P/D worker's counters, or its layout once up
                assert self.pd is not None
                self.pd.report(msg)
            else:
                front.handle(msg)

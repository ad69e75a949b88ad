"""Serving on tp x cp x pp local ranks: rank 0 takes the requests, every rank runs the same steps.

The HTTP process is no rank: it spawns the ranks (kvstrata.parallel.group.run_ranks, fork) from a
thread and talks to rank 0 through two multiprocessing queues. Each step rank 0 drains its inbox
(typed step inputs: new requests, aborts, calls, stop) and broadcasts them with its clock and
whether to step, so every rank runs the same step loop (kvstrata/serve/step_loop.py) alike; samplers are rebuilt on each rank from the request's
SamplingParams and seed, so every rank draws the same token. Rank 0 sends tokens and endings back;
a dispatcher thread in the HTTP process hands them to the requests' streams.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.step_io import Ready, SideCount, SideReady, StepInputs, Stop
from kvstrata.parallel.config import DistConfig
from kvstrata.parallel.group import RankContext
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.events import KVEventPublisher, rank0_events
from kvstrata.serve.loop import LoopFront
from kvstrata.serve.step_loop import IDLE_WAIT_S, StepLoop, next_inputs
from kvstrata.storage.base import StorageConfig

STATS_EVERY_S = 0.5  # rank 0 reports pools, counters and agreement latencies this often
FOREVER_S = 10 * 365 * 86400.0  # run_ranks' bound on the whole run: a server runs until stopped


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
    inbox: Any,
    outbox: Any,
    serve_cfg: ServeConfig | None = None,
    pd_cfg: Any = None,
) -> dict[str, Any]:
    from kvstrata.parallel.ranks import RankEngine, RankOptions

    if threading.current_thread() is threading.main_thread():  # (torchrun's rank 0: a thread)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process decides when ranks stop
    out = outbox if ctx.rank == 0 else None
    pd = None
    if serve_cfg is not None and serve_cfg.role in ("prefill", "decode"):
        from kvstrata.pd.ranks import RankPD  # this rank's side of a P/D worker

        pd = RankPD(serve_cfg.role, pd_cfg, ctx.rank, engine_cfg.max_running, inbox, out)
    gate = pd.gate if pd is not None else None
    re = RankEngine(ctx, engine_cfg, cache_cfg, storage_cfg, RankOptions(), extra=gate)
    eng = re.engine
    events = rank0_events(serve_cfg, cache_cfg.page_size, eng) if out is not None else None
    try:
        if pd is not None:
            pd.attach(re)
        _serve_steps(re, inbox, out, events, pd)
    finally:
        if events is not None:
            events.close()
        if pd is not None:
            pd.close()
    return {"rank": ctx.rank, "steps": eng.steps}


def _serve_steps(
    re: Any, inbox: Any, out: Any | None, events: KVEventPublisher | None, pd: Any = None
) -> None:
    """Every rank: the same step loop over the inputs rank 0 broadcasts."""
    eng, rank0 = re.engine, out is not None
    steps = StepLoop(eng, out.put if out else None, _gather(rank0), pd, events, STATS_EVERY_S)
    if out is not None:
        eng.agree = steps.timed(eng.agree)
        out.put(Ready())
    while True:
        box: list[Any] = [next_inputs(eng, inbox) if rank0 else None]
        dist.broadcast_object_list(box, src=0)
        msg: StepInputs = box[0]
        re.now = msg.clock
        if not steps.apply(msg):
            break
    eng.check_integrity()
    re.close()  # drains pending cache ops (storage backups), agreed
    eng.check_integrity()
    if events is not None:
        events.after_step(eng)  # the drained state (new storage copies) is reported too


class RankedLoop(LoopFront):
    """The step loop over ranks in child processes (see the module docstring), or, under
    torchrun (torchrun=True), over this process as rank 0, stepping in a thread of it."""

    def __init__(
        self,
        configs: tuple[EngineConfig, CacheConfig, StorageConfig],
        dist_cfg: DistConfig,
        max_pending: int,
        serve_cfg: ServeConfig | None = None,
        torchrun: bool = False,
        pd: Any = None,
    ) -> None:
        """pd: the HTTP side of a P/D worker (kvstrata.pd.worker.PDWorker, ranked), which rank 0
        tells its layout and endpoints and forwards its hand-off counters to."""
        import torch.multiprocessing as tmp

        self.torchrun = torchrun
        if torchrun:  # rank 0 is a thread of this process: plain thread-safe queues
            inbox: Any = queue.Queue()
            self.outbox: Any = queue.Queue()
        else:
            mp = tmp.get_context("fork")
            inbox, self.outbox = mp.Queue(), mp.Queue()
        super().__init__(max_pending, inbox)
        self.configs, self.dist_cfg = configs, dist_cfg
        self.serve_cfg, self.pd = serve_cfg, pd
        self._done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvstrata-ranks", daemon=True)
        self._dispatch = threading.Thread(
            target=self._dispatcher, name="kvstrata-dispatch", daemon=True
        )

    def start(self) -> None:
        self.thread.start()
        self._dispatch.start()

    def stop(self, timeout_s: float) -> bool:
        self.inbox.put(Stop())
        self.thread.join(timeout_s)
        self._done.set()
        self._dispatch.join(5.0)
        return not self.thread.is_alive()

    # ---- threads of the HTTP process -------------------------------------------------------------
    def _run(self) -> None:
        from kvstrata.parallel.group import init_ranks, run_ranks, teardown

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
            self.failed = f"{type(exc).__name__}: {exc}"
            print(f"kvstrata serve: ranks stopped: {self.failed}", file=sys.stderr)
        finally:
            self.ready.set()
            if self.failed:
                self._fail_all(f"the ranks stopped: {self.failed}")

    def _dispatcher(self) -> None:
        while not self._done.is_set():
            try:
                msg = self.outbox.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                continue
            if isinstance(msg, Ready):
                self.ready.set()
            elif isinstance(msg, SideCount):  # a P/D worker's counters
                getattr(self.pd.metrics, msg.name)(*msg.args)
            elif isinstance(msg, SideReady):  # a P/D worker's layout, once up
                self.pd.ranked_ready(msg.layout, msg.endpoints)
            else:
                self.handle(msg)

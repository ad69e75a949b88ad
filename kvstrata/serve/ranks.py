"""Serving on tp x cp x pp local ranks: rank 0 takes the requests, every rank runs the same steps.

The HTTP process is no rank: it spawns the ranks (kvstrata.parallel.group.run_ranks, fork) from a
thread and talks to rank 0 through two multiprocessing queues. Each step rank 0 drains its inbox
(new requests, aborts, stop) and broadcasts that with its clock and whether to step, so every
rank submits, aborts and steps identically; samplers are rebuilt on each rank from the request's
SamplingParams and seed, so every rank draws the same token. Rank 0 sends tokens and endings back;
a dispatcher thread in the HTTP process hands them to the requests' streams.
"""

from __future__ import annotations

import concurrent.futures
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request
from kvstrata.engine.step_io import (
    Abort,
    Call,
    CallDone,
    Failed,
    Finished,
    NewRequest,
    Ready,
    SideCount,
    SideReady,
    StatsOut,
    StepInputs,
    Stop,
    TokenOut,
)
from kvstrata.parallel.config import DistConfig
from kvstrata.parallel.group import RankContext
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.events import KVEventPublisher, rank0_events
from kvstrata.serve.loop import IDLE_WAIT_S, LoopObserver, QueueFull, Stream
from kvstrata.serve.metrics import PoolStats, ServeMetrics, engine_stats
from kvstrata.storage.base import StorageConfig

STATS_EVERY_S = 0.5  # rank 0 reports pools, counters and agreement latencies this often
FOREVER_S = 10 * 365 * 86400.0  # run_ranks' bound on the whole run: a server runs until stopped


def _rank0_inputs(inbox: Any, idle: bool) -> list[Any]:
    """What waits in rank 0's inbox: NewRequest, Abort, Call, Stop (blocks briefly if idle)."""
    items: list[Any] = []
    try:
        items.append(inbox.get(timeout=IDLE_WAIT_S) if idle else inbox.get_nowait())
        while True:
            items.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return items


def _timed(agree: Callable[[list[int]], list[int]], into: list[float]) -> Any:
    """The engine's agreement hook, timing each call (rank 0 reports the durations)."""

    def timed(local: list[int]) -> list[int]:
        t0 = time.perf_counter()
        agreed = agree(local)
        into.append(time.perf_counter() - t0)
        return agreed

    return timed


def _rank0_message(eng: Engine, inbox: Any) -> StepInputs:
    """This step's inputs, rank 0's clock, and whether every rank steps."""
    busy = eng.has_work() or (eng.cache is not None and len(eng.cache.queues) > 0)
    items = _rank0_inputs(inbox, idle=not busy)
    new = [x for x in items if isinstance(x, NewRequest)]
    return StepInputs(
        new=new,
        aborts=[x.rid for x in items if isinstance(x, Abort)],
        clock=time.monotonic(),
        stop=any(isinstance(x, Stop) for x in items),
        step=busy or bool(new),
        calls=[x for x in items if isinstance(x, Call)],
    )


def _run_calls(eng: Engine, calls: list[Call], out: Any | None) -> None:
    """Every rank runs each call (fn(engine), between steps); rank 0 gathers and reports them."""
    for call in calls:
        try:
            mine: tuple[bool, Any] = (True, call.fn(eng))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, naming the rank
            mine = (False, f"{type(exc).__name__}: {exc}")
        gathered: list[Any] = [None] * dist.get_world_size() if out is not None else []
        dist.gather_object(mine, gathered if out is not None else None, dst=0)
        if out is not None:
            out.put(CallDone(call.call_id, gathered))


def _submit(eng: Engine, new: NewRequest, outbox: Any | None, pd: Any = None) -> None:
    """Every rank builds the same request (a P/D hand-off's side hears of it first)."""
    req = new.build()
    if pd is not None:
        pd.submitted(req, new.handoff)
    try:
        eng.submit(req)  # the same inputs on every rank: the same outcome
    except (ValueError, TypeError) as exc:
        if pd is not None:
            pd.ended(req, str(exc))
        if outbox is not None:
            outbox.put(Failed(new.rid, str(exc)))


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


def _ended(req: Request, out: Any | None, pd: Any) -> None:
    """A request ended on this rank: its P/D sink hears it; rank 0 reports it."""
    if pd is not None:
        pd.ended(req)
    if out is None:
        return
    if req.failure is not None:  # a P/D hand-off failed: (status, message)
        out.put(Failed(req.rid, req.failure))
    else:  # spec_*: usage.spec on the HTTP side
        hits, spec = dict(req.hits), list(req.spec_accepts)
        out.put(Finished(req.rid, req.finish_reason, hits, req.transfer, spec, req.spec_proposed))


def _on_token(out: Any | None, pd: Any) -> Callable[[Request, int], None]:
    def on_token(req: Request, tok: int) -> None:
        if pd is not None:
            pd.on_token(req, tok)  # a P/D prefill sends its pages at the first token
        if out is not None:
            out.put(TokenOut(req.rid, tok, dict(req.hits) if len(req.output) == 1 else None))

    return on_token


def _serve_steps(
    re: Any, inbox: Any, out: Any | None, events: KVEventPublisher | None, pd: Any = None
) -> None:
    """Every rank: the same requests, aborts and steps, as rank 0 broadcasts them."""
    eng, rank0 = re.engine, out is not None
    timings: list[float] = []
    if out is not None or pd is not None:
        eng.on_token = _on_token(out, pd)
    if out is not None:
        eng.agree = _timed(eng.agree, timings)
        out.put(Ready())
    last_stats = 0.0
    while True:
        box: list[Any] = [_rank0_message(eng, inbox) if rank0 else None]
        dist.broadcast_object_list(box, src=0)
        msg: StepInputs = box[0]
        re.now = msg.clock
        _run_calls(eng, msg.calls, out)
        aborts = [r.rid for r in [*eng.waiting, *eng.running]] if msg.stop else msg.aborts
        for rid in aborts:
            req = eng.abort(rid)
            if req is not None:
                _ended(req, out, pd)
        if msg.stop:
            break
        for new in msg.new:
            _submit(eng, new, out, pd)
        if msg.step:
            for req in eng.step():
                _ended(req, out, pd)
                if events is not None:
                    events.record(req)
        if events is not None and (msg.step or aborts or msg.calls):  # a call may reset the cache
            events.after_step(eng)
        elif events is not None:
            events.on_idle()
        if out is not None and re.now - last_stats > STATS_EVERY_S:
            last_stats = re.now
            out.put(StatsOut(engine_stats(eng), list(timings)))
            timings.clear()
    eng.check_integrity()
    re.close()  # drains pending cache ops (L3 backups), agreed
    eng.check_integrity()
    if events is not None:
        events.after_step(eng)  # the drained state (new L3 copies) is reported too


class RankedLoop:
    """The EngineLoop interface over ranks in child processes (see the module docstring), or,
    under torchrun (torchrun=True), over this process as rank 0, stepping in a thread of it."""

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
            self.inbox: Any = queue.Queue()
            self.outbox: Any = queue.Queue()
        else:
            mp = tmp.get_context("fork")
            self.inbox, self.outbox = mp.Queue(), mp.Queue()
        self.configs, self.dist_cfg, self.max_pending = configs, dist_cfg, max_pending
        self.serve_cfg, self.pd = serve_cfg, pd
        self.observers: list[LoopObserver] = []
        self.failed: str | None = None
        self.stats: PoolStats | None = None  # rank 0's latest report
        self.ready = threading.Event()
        self._done = threading.Event()
        self._streams: dict[str, tuple[Request, Stream]] = {}
        self._lock = threading.Lock()
        self.pending = 0
        self._calls = 0
        self._futures: dict[int, concurrent.futures.Future[Any]] = {}
        self._every: dict[int, bool] = {}
        self.thread = threading.Thread(target=self._run, name="kvstrata-ranks", daemon=True)
        self._dispatch = threading.Thread(
            target=self._dispatcher, name="kvstrata-dispatch", daemon=True
        )

    def start(self) -> None:
        self.thread.start()
        self._dispatch.start()

    def submit(self, req: Request, stream: Stream) -> None:
        with self._lock:
            if self.pending >= self.max_pending:
                raise QueueFull(f"{self.pending} requests in flight (max_pending)")
            self.pending += 1
            self._streams[req.rid] = (req, stream)
        assert req.sampler is not None
        params = req.sampler.params
        new = NewRequest(
            req.rid, req.tokens, req.max_new_tokens, params, req.cache_salt, req.remote
        )
        self.inbox.put(new)

    def abort(self, rid: str) -> None:
        self.inbox.put(Abort(rid))

    def abort_all(self) -> None:
        """Abort every request in flight (their streams end with finish_reason "abort")."""
        for rid in list(self._streams):
            self.abort(rid)

    def call(
        self, fn: Callable[[Engine], Any], every_rank: bool = False
    ) -> concurrent.futures.Future[Any]:
        """Run fn(engine) on every rank between steps (fn: a module-level function); the
        future gets rank 0's result (every_rank: the list of every rank's, rank order), or an
        error naming the first rank whose call raised."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._calls += 1
            call_id = self._calls
            self._futures[call_id] = fut
            self._every[call_id] = every_rank
        self.inbox.put(Call(call_id, fn))
        return fut

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
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Ready):
            self.ready.set()
        elif isinstance(msg, CallDone):
            self._called(msg.call_id, msg.results)
        elif isinstance(msg, SideCount):  # a P/D worker's counters
            getattr(self.pd.metrics, msg.name)(*msg.args)
        elif isinstance(msg, SideReady):  # a P/D worker's layout, once up
            self.pd.ranked_ready(msg.layout, msg.endpoints)
        elif isinstance(msg, StatsOut):
            self.stats = msg.stats
            for obs in self.observers:
                if isinstance(obs, ServeMetrics):
                    obs.on_stats(msg.stats, msg.agree_s)
        elif isinstance(msg, TokenOut | Finished | Failed):
            entry = self._streams.get(msg.rid)
            if entry is not None:
                self._to_stream(msg, *entry)

    def _to_stream(self, msg: TokenOut | Finished | Failed, req: Request, stream: Stream) -> None:
        now = time.monotonic()
        if isinstance(msg, TokenOut):
            if msg.hits is not None:  # the first token: its hits, and (approximately) admission
                req.hits = msg.hits
                for obs in self.observers:
                    obs.on_admitted(req, stream, now)
            for obs in self.observers:
                obs.on_token(req, stream, now)
            stream.last_token_s = now
            stream.push("token", msg.token)
            return
        self._end(msg.rid)
        if isinstance(msg, Failed):
            stream.push("error", msg.error)
            return
        req.finish_reason, req.hits, req.transfer = msg.reason, msg.hits, msg.transfer
        req.spec_accepts, req.spec_proposed = msg.spec_accepts, msg.spec_proposed
        for obs in self.observers:
            obs.on_finished(req, stream, now)
        stream.push("done", req)

    def _called(self, call_id: int, results: list[tuple[bool, Any]]) -> None:
        with self._lock:
            fut = self._futures.pop(call_id, None)
            every = self._every.pop(call_id, False)
        if fut is None:
            return
        failed = [(r, v) for r, (ok, v) in enumerate(results) if not ok]
        if failed:
            fut.set_exception(AssertionError(f"rank {failed[0][0]}: {failed[0][1]}"))
        else:
            fut.set_result([v for _, v in results] if every else results[0][1])

    def _end(self, rid: str) -> None:
        with self._lock:
            if self._streams.pop(rid, None) is not None:
                self.pending -= 1

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            entry = self._streams.get(rid)
            self._end(rid)
            if entry is not None:
                entry[1].push("error", message)

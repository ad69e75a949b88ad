"""The HTTP side of the engine loop, and the loop of one rank in a thread of the server.

Requests, aborts and calls go into an inbox; the step loop (kvstrata/serve/step_loop.py) takes
them between steps, on the engine thread of this process (one rank, `EngineLoop`) or in rank 0
of several (kvstrata/serve/ranks.py, `RankedLoop`), and reports typed outputs that `LoopFront`
hands to each request's stream: tokens go back to each request's asyncio queue through
`call_soon_threadsafe`, so the event loop never waits on a step and a step never waits on a
client. Every wait here has a bound. On one rank an exception inside a step fails the requests
in flight (their clients get an error) and the loop goes on: the thread never dies while the
server is up.
"""

from __future__ import annotations

import concurrent.futures
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.engine import step_io as io
from kvstrata.engine.build import Built
from kvstrata.engine.engine import Engine
from kvstrata.serve.events import KVEventPublisher
from kvstrata.serve.request_record import RequestRecord
from kvstrata.serve.step_loop import StepLoop, run_steps
from kvstrata.serve.stream import LoopObserver, QueueFull, Stream


class LoopFront:
    """The HTTP side of a step loop: its inbox, the streams in flight and their outputs."""

    def __init__(self, max_pending: int, inbox: io.Inbox) -> None:
        self.max_pending = max_pending
        self.inbox = inbox
        self.observers: list[LoopObserver] = []
        self.failed: str | None = None  # why the engine could not be built or the ranks stopped
        self.ready = threading.Event()
        self.stats: Any = None  # the latest StatsOut's PoolStats
        self._streams: dict[str, tuple[RequestRecord, Stream]] = {}
        self._lock = threading.Lock()
        self.pending = 0
        self._calls = 0
        self._futures: dict[int, tuple[concurrent.futures.Future[Any], bool]] = {}

    def local_engine(self) -> Engine | None:
        """The engine when it runs in this process's thread and is built (None under ranks:
        it runs in the rank processes)."""
        return None

    def submit(self, req: RequestRecord, stream: Stream) -> None:
        """Send a new request to the engine (it builds its own Request from req.new(), on
        every rank alike); its outputs go to `stream` and update `req`."""
        with self._lock:
            if self.pending >= self.max_pending:
                raise QueueFull(f"{self.pending} requests in flight (max_pending)")
            self.pending += 1
            self._streams[req.rid] = (req, stream)
        self.inbox.put(req.new())

    def abort(self, rid: str) -> None:
        self.inbox.put(io.Abort(rid))

    def abort_all(self) -> None:
        """Abort every request in flight (their streams end with finish_reason "abort")."""
        for rid in list(self._streams):
            self.abort(rid)

    def call(
        self, fn: Callable[[Engine], Any], every_rank: bool = False
    ) -> concurrent.futures.Future[Any]:
        """Run fn(engine) on every rank between steps (fn: a module-level function under
        ranks); the future gets rank 0's result (every_rank: the list of every rank's, rank
        order), or an error naming the first rank whose call raised."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._calls += 1
            call_id = self._calls
            self._futures[call_id] = (fut, every_rank)
        self.inbox.put(io.Call(call_id, fn))
        return fut

    # ---- outputs --------------------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        """One output of the step loop."""
        if isinstance(msg, io.CallDone):
            self._called(msg.call_id, msg.results)
        elif isinstance(msg, io.StatsOut):
            self.stats = msg.stats
            for obs in self.observers:
                obs.on_stats(msg.stats, msg.agree_s)
        elif isinstance(msg, io.TokenOut | io.Admitted | io.Finished | io.Failed):
            entry = self._streams.get(msg.rid)
            if entry is not None:
                self._to_stream(msg, *entry)

    def _to_stream(self, msg: Any, req: RequestRecord, stream: Stream) -> None:
        now = time.monotonic()
        if isinstance(msg, io.Admitted):
            req.admitted(msg)
            for obs in self.observers:
                obs.on_admitted(req, stream, msg.at_s)
            return
        if isinstance(msg, io.TokenOut):
            for obs in self.observers:
                obs.on_token(req, stream, now)
            stream.last_token_s = now
            stream.push("token", msg.token)
            return
        self._end(msg.rid)
        if isinstance(msg, io.Failed):
            stream.push("error", msg.error)
            return
        req.finished(msg)
        for obs in self.observers:
            obs.on_finished(req, stream, now)
        stream.push("done", req)

    def _called(self, call_id: int, results: list[tuple[bool, Any]]) -> None:
        with self._lock:
            fut, every = self._futures.pop(call_id, (None, False))
        if fut is None:
            return
        failed = [(r, v) for r, (ok, v) in enumerate(results) if not ok]
        if failed and isinstance(failed[0][1], BaseException):  # one rank: the error itself
            fut.set_exception(failed[0][1])
        elif failed:
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

    def _fail_calls(self, message: str) -> None:
        """Calls still waiting get an answer, not a hang."""
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
        for fut, _ in futures:
            fut.set_exception(RuntimeError(message))


@dataclass
class LoopParts:
    """What one rank's step loop runs with, made on its engine thread."""

    built: Built
    events: KVEventPublisher | None = None  # KV events publisher (--kv-events-endpoint)


class EngineLoop(LoopFront):
    """Builds the engine in its own thread, then runs the step loop on it until stopped.

    build(inbox): the loop's parts (the inbox: where a P/D prefill side submits hand-offs)."""

    def __init__(self, build: Callable[[io.Inbox], LoopParts], max_pending: int) -> None:
        super().__init__(max_pending, queue.SimpleQueue())
        self._build = build
        self.built: Built | None = None
        self.thread = threading.Thread(target=self._main, name="kvstrata-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def engine(self) -> Engine:
        assert self.built is not None
        return self.built.engine

    def local_engine(self) -> Engine | None:
        return self.built.engine if self.built is not None else None

    def stop(self, timeout_s: float) -> bool:
        """Abort what is left, drain pending cache ops, close; False when the thread is late."""
        self.inbox.put(io.Stop())
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def _main(self) -> None:
        try:
            parts = self._build(self.inbox)
        except Exception as exc:  # noqa: BLE001 - reported by /health and on stderr
            self.failed = f"{type(exc).__name__}: {exc}"
            print(f"kvstrata serve: engine failed to start: {self.failed}", file=sys.stderr)
            self.ready.set()
            return
        self.built, events = parts.built, parts.events
        eng = self.engine
        steps = StepLoop(eng, self.handle, lambda mine: [mine], events, survive_errors=True)
        self.ready.set()
        try:
            run_steps(steps, self.inbox)  # one rank: its own inputs, identity agreement
        finally:
            self._fail_calls("server is stopping")
            self._fail_all("server is stopping")  # requests that raced the stop
            self.built.close()  # engine.drain(): every pending backup reaches storage
            if events is not None:
                events.after_step(eng)  # the drained state (new storage copies) is reported
                events.close()

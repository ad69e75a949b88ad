"""The HTTP side of the engine loop, for one rank or many: one `LoopFront` over its `Ranks`.

Requests, aborts and calls go into an inbox; the step loop (kvstrata/serve/step_loop.py) takes
them between steps and reports typed outputs that `LoopFront` hands to each request's stream:
tokens go back to each request's asyncio queue through `call_soon_threadsafe`, so the event loop
never waits on a step and a step never waits on a client. Where the step loop runs is the front's
composed `Ranks`: one rank on an engine thread of this process (`LocalRank`: its own inputs are
every rank's, its outputs reach the front in that thread), or tp x cp x pp ranks whose rank 0
broadcasts the inputs and sends the outputs back over a queue (kvstrata/serve/ranks.py,
`DistRanks`). Every wait here has a bound. On one rank an exception inside a step fails the
requests in flight (their clients get an error) and the loop goes on: the thread never dies while
the server is up.
"""

from __future__ import annotations

import concurrent.futures
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvstrata.engine import step_io as io
from kvstrata.engine.build import Built
from kvstrata.engine.engine import Engine
from kvstrata.serve.events import KVEventPublisher
from kvstrata.serve.metrics import PoolStats
from kvstrata.serve.request_record import RequestRecord
from kvstrata.serve.step_loop import ONE_RANK, StepLoop, run_steps
from kvstrata.serve.stream import LoopObserver, QueueFull, Stream

RequestOutput = io.TokenOut | io.Admitted | io.Finished | io.Failed
"""The step loop's outputs about one request (the rest: calls' results and pool stats)."""


class LoopFront:
    """The HTTP side of a step loop: its inbox, the streams in flight and their outputs."""

    def __init__(self, max_pending: int, ranks: Ranks) -> None:
        self.max_pending = max_pending
        self.ranks = ranks
        self.inbox = ranks.inbox
        self.observers: list[LoopObserver] = []
        self.failed: str | None = None  # why the engine could not be built or the ranks stopped
        self.ready = threading.Event()
        self.stats: PoolStats | None = None  # the latest StatsOut's
        self._streams: dict[str, tuple[RequestRecord, Stream]] = {}
        self._lock = threading.Lock()
        self.pending = 0
        self._calls = 0
        self._futures: dict[int, tuple[concurrent.futures.Future[Any], bool]] = {}

    def start(self) -> None:
        """Build the engine (one rank) or start the ranks; `ready` is set once they serve."""
        self.ranks.start(self)

    def stop(self, timeout_s: float) -> bool:
        """Abort what is left, drain pending cache ops, close; False when the ranks are late."""
        self.inbox.put(io.Stop())
        self.ranks.join(timeout_s)
        return not self.thread.is_alive()

    @property
    def thread(self) -> threading.Thread:
        """The thread that ends when the step loop ended (a stop, or a failure)."""
        return self.ranks.thread

    def local_engine(self) -> Engine | None:
        """The engine when it runs in this process's thread and is built (None under ranks:
        it runs in the rank processes)."""
        return self.ranks.local_engine()

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
    def handle(self, msg: io.StepOutput) -> None:
        """One output of the step loop."""
        if isinstance(msg, io.CallDone):
            self._called(msg.call_id, msg.results)
        elif isinstance(msg, io.StatsOut):
            self.stats = msg.stats
            for obs in self.observers:
                obs.on_stats(msg.stats, msg.agree_s)
        elif isinstance(msg, RequestOutput):
            entry = self._streams.get(msg.rid)
            if entry is not None:
                self._to_stream(msg, *entry)

    def _to_stream(self, msg: RequestOutput, req: RequestRecord, stream: Stream) -> None:
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

    def fail_all(self, message: str) -> None:
        """Every request in flight ends with an error naming `message`."""
        for rid in list(self._streams):
            entry = self._streams.get(rid)
            self._end(rid)
            if entry is not None:
                entry[1].push("error", message)

    def fail_calls(self, message: str) -> None:
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


class Ranks(Protocol):
    """Where a LoopFront's step loop runs, and how its inputs and outputs cross to it."""

    inbox: io.Inbox  # the step inputs' queue: NewRequest, Abort, Call, Stop
    thread: threading.Thread  # ends when the step loop ended: a stop or a failure
    fatal_stop: bool  # ranks that stop by themselves (died, hung, diverged) never come back

    def start(self, front: LoopFront) -> None:
        """Run the step loop; its outputs go to front.handle, front.ready is set once it
        serves, front.failed names why it could not start or stopped."""
        ...

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for the step loop to end once told to stop."""
        ...

    def local_engine(self) -> Engine | None:
        """The engine when it runs in this process's thread and is built."""
        ...


class LocalRank:
    """N = 1: builds the engine in its own thread, then runs the step loop on it until stopped;
    its inputs are every rank's (identity agreement) and its outputs reach the front in that
    thread. A step that raises fails the requests in flight and the loop goes on.

    build(inbox): the loop's parts (the inbox: where a P/D prefill side submits hand-offs)."""

    fatal_stop = False  # a build failure is reported by /health; the thread ends only then

    def __init__(self, build: Callable[[io.Inbox], LoopParts]) -> None:
        self.inbox: io.Inbox = queue.SimpleQueue()
        self._build = build
        self.built: Built | None = None
        self.thread = threading.Thread(target=self._main, name="kvstrata-engine", daemon=True)
        self._front: LoopFront | None = None

    def start(self, front: LoopFront) -> None:
        self._front = front
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def local_engine(self) -> Engine | None:
        return self.built.engine if self.built is not None else None

    def _main(self) -> None:
        front = self._front
        assert front is not None
        try:
            parts = self._build(self.inbox)
        except Exception as exc:  # noqa: BLE001 - reported by /health and on stderr
            front.failed = f"{type(exc).__name__}: {exc}"
            print(f"kvstrata serve: engine failed to start: {front.failed}", file=sys.stderr)
            front.ready.set()
            return
        self.built, events = parts.built, parts.events
        eng = parts.built.engine
        steps = StepLoop(eng, front.handle, ONE_RANK, events, survive_errors=True)
        front.ready.set()
        try:
            run_steps(steps, self.inbox)  # one rank: its own inputs are every rank's
        finally:
            front.fail_calls("server is stopping")
            front.fail_all("server is stopping")  # requests that raced the stop
            parts.built.close()  # engine.drain(): every pending backup reaches storage
            if events is not None:  # the drained state (new storage copies) is reported
                events.after_step(eng.cache, eng.between_steps())
                events.close()

"""The engine loop: one thread owns the Engine and steps it; the HTTP side only hands over.

Requests and commands arrive through thread-safe queues; tokens go back to each request's
asyncio queue through `call_soon_threadsafe`, so the event loop never waits on a step and a step
never waits on a client. Every wait here has a bound. An exception inside a step fails the
requests in flight (their clients get an error) and the loop goes on: the thread never dies
while the server is up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstrata.engine.build import Built
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request

IDLE_WAIT_S = 0.05  # no work: sleep until woken, at most this long
# With no request but cache ops pending (L1 -> L2 stores, L3 backups) the loop still steps, so
# their results are applied (pages unpinned, events sent) without waiting for the next request.


class QueueFull(Exception):
    """More requests in flight than ServeConfig.max_pending."""


@dataclass
class Stream:
    """Where one request's tokens go: an asyncio queue on the server's event loop."""

    aloop: asyncio.AbstractEventLoop
    received_s: float  # time.monotonic() when the HTTP request arrived
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    last_token_s: float | None = None

    def push(self, kind: str, value: Any) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class LoopObserver:
    """What metrics and events see of the loop (all called on the engine thread)."""

    def on_token(self, req: Request, stream: Stream, now_s: float) -> None: ...

    def on_admitted(self, req: Request, stream: Stream, now_s: float) -> None: ...

    def on_finished(self, req: Request, stream: Stream, now_s: float) -> None: ...

    def after_step(self, engine: Engine) -> None: ...

    def on_idle(self) -> None: ...

    def close(self) -> None: ...


class EngineLoop:
    """Builds the engine in its own thread, then steps it until stopped."""

    def __init__(self, build: Callable[[], Built], max_pending: int) -> None:
        self._build = build
        self.max_pending = max_pending
        self.observers: list[LoopObserver] = []
        self.built: Built | None = None
        self.failed: str | None = None  # why the engine could not be built
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._requests: queue.SimpleQueue[tuple[Request, Stream]] = queue.SimpleQueue()
        self._control: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._admitted: set[str] = set()
        self._lock = threading.Lock()
        self.pending = 0
        self.thread = threading.Thread(target=self._main, name="kvstrata-engine", daemon=True)

    # ---- called from the HTTP side --------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    @property
    def engine(self) -> Engine:
        assert self.built is not None
        return self.built.engine

    def submit(self, req: Request, stream: Stream) -> None:
        with self._lock:
            if self.pending >= self.max_pending:
                raise QueueFull(f"{self.pending} requests in flight (max_pending)")
            self.pending += 1
        self._requests.put((req, stream))
        self._wake.set()

    def abort(self, rid: str) -> None:
        self._control.put(("abort", rid))
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every request in flight (their streams end with finish_reason "abort")."""
        self._control.put(("abort_all", None))
        self._wake.set()

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future[Any]:
        """Run fn(engine) on the engine thread between steps."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._control.put(("call", (fn, fut)))
        self._wake.set()
        return fut

    def stop(self, timeout_s: float) -> bool:
        """Abort what is left, drain pending cache ops, close; False when the thread is late."""
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        return not self.thread.is_alive()

    # ---- the engine thread ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.built = self._build()
        except Exception as exc:  # noqa: BLE001 - reported by /health and on stderr
            self.failed = f"{type(exc).__name__}: {exc}"
            print(f"kvstrata serve: engine failed to start: {self.failed}", file=sys.stderr)
            self.ready.set()
            return
        self.engine.on_token = self._on_token
        self.ready.set()
        try:
            while not self._stop.is_set():
                self._iterate()
        finally:
            self._shutdown()

    def _iterate(self) -> None:
        self._take_requests()
        self._commands()
        cache = self.engine.cache
        if not self.engine.has_work() and not (cache is not None and len(cache.queues)):
            self._wake.wait(IDLE_WAIT_S)
            self._wake.clear()
            for obs in self.observers:
                obs.on_idle()
            return
        step_start = time.monotonic()
        try:
            finished = self.engine.step()
        except Exception:  # noqa: BLE001 - fail the requests in flight, keep serving
            traceback.print_exc(file=sys.stderr)
            self._fail_all("internal error in an engine step")
            return
        for req in [*self.engine.running, *finished]:  # admitted in this step: queue time ends
            if req.rid not in self._admitted and req.rid in self._streams:
                self._admitted.add(req.rid)
                for obs in self.observers:
                    obs.on_admitted(req, self._streams[req.rid], step_start)
        now = time.monotonic()
        for req in finished:
            self._finish(req, now)
        for obs in self.observers:
            obs.after_step(self.engine)

    def _take_requests(self) -> None:
        while True:
            try:
                req, stream = self._requests.get_nowait()
            except queue.Empty:
                return
            try:
                self.engine.submit(req)
            except (ValueError, TypeError) as exc:
                self._release()
                stream.push("error", str(exc))
                continue
            self._streams[req.rid] = stream

    def _commands(self) -> None:
        while True:
            try:
                kind, arg = self._control.get_nowait()
            except queue.Empty:
                return
            if kind in ("abort", "abort_all"):
                self._abort(list(self._streams) if kind == "abort_all" else [arg])
            else:
                fn, fut = arg
                try:
                    fut.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
                for obs in self.observers:  # a call may change the tree (a prefix-cache reset)
                    obs.after_step(self.engine)

    def _abort(self, rids: list[str]) -> None:
        """Abort these requests (pages released at once); their streams get "done"."""
        aborted = False
        for rid in rids:
            req = self.engine.abort(rid)
            if req is not None:
                self._finish(req, time.monotonic())
                aborted = True
        if aborted:
            for obs in self.observers:
                obs.after_step(self.engine)

    def _on_token(self, req: Request, token: int) -> None:
        stream = self._streams.get(req.rid)
        if stream is None:
            return
        now = time.monotonic()
        for obs in self.observers:
            obs.on_token(req, stream, now)
        stream.last_token_s = now
        stream.push("token", token)

    def _finish(self, req: Request, now_s: float) -> None:
        stream = self._streams.pop(req.rid, None)
        self._admitted.discard(req.rid)
        if stream is None:
            return
        self._release()
        for obs in self.observers:
            obs.on_finished(req, stream, now_s)
        if req.failure is not None:  # a remote prefill failed: (status, message)
            stream.push("error", req.failure)
        else:
            stream.push("done", req)

    def _release(self) -> None:
        with self._lock:
            self.pending -= 1

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - already failing; the stream still gets its error
                traceback.print_exc(file=sys.stderr)
            stream = self._streams.pop(rid)
            self._admitted.discard(rid)
            self._release()
            stream.push("error", message)

    def _shutdown(self) -> None:
        """Abort what is still in flight, wait for pending L3 backups, close the parts."""
        self._take_requests()
        self._commands()
        self._abort(list(self._streams))
        while True:  # calls that raced the stop get an answer, not a hang
            try:
                kind, arg = self._control.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                arg[1].set_exception(RuntimeError("server is stopping"))
        assert self.built is not None
        self.built.close()  # engine.drain(): every pending backup reaches storage
        for obs in self.observers:
            obs.after_step(self.engine)  # the drained state (new L3 copies) is reported too
            obs.close()

"""One step loop for one rank and for many: typed step inputs in, typed outputs out.

Each iteration applies one StepInputs (kvstrata.engine.step_io): new requests, calls between
steps, aborts (a stop aborts everything), then one engine step when there is work. Rank 0 takes
the inputs from its inbox (`next_inputs`) and the loop's `FanOut` gives every rank the same ones
with the same clock: on one rank the identity, under several a broadcast. What happens
goes out as TokenOut, Admitted, Finished, Failed, StatsOut and CallDone messages: on one rank
to the HTTP side's handler in this thread, under ranks (rank 0 only) to the HTTP process's
queue. The loop knows no P/D side: a worker's side is the engine's connector, driven by the
engine itself.
"""

from __future__ import annotations

import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request
from kvstrata.engine.step_io import (
    Abort,
    Admitted,
    Call,
    CallDone,
    Failed,
    Finished,
    Inbox,
    InboxItem,
    NewRequest,
    StatsOut,
    StepInputs,
    StepOutput,
    Stop,
    TokenOut,
)
from kvstrata.engine.step_result import StepResult
from kvstrata.serve.events import KVEventPublisher
from kvstrata.serve.metrics import engine_stats

IDLE_WAIT_S = 0.05  # no work: wait this long at most for an input
# With no request but cache ops pending (device -> host stores, storage backups) the loop still
# steps, so their results are applied (pages unpinned, events sent) without waiting for the next
# request.

Out = Callable[[StepOutput], None]
Gather = Callable[[tuple[bool, Any]], list[tuple[bool, Any]] | None]
"""This rank's (ok, result) of a call -> every rank's, on the rank that reports (else None)."""


Share = Callable[[StepInputs | None], StepInputs]
"""Rank 0's step inputs -> this rank's (one rank: its own; several: rank 0's broadcast)."""


def own_inputs(msg: StepInputs | None) -> StepInputs:
    """One rank's Share: the inputs it took are every rank's."""
    assert msg is not None
    return msg


def own_result(mine: tuple[bool, Any]) -> list[tuple[bool, Any]]:
    """One rank's Gather: its result is every rank's."""
    return [mine]


@dataclass(frozen=True)
class FanOut:
    """How rank 0's step inputs reach every rank and a call's results come back to it: on one
    rank the identity (ONE_RANK); under several a broadcast and a gather (kvstrata/serve/ranks.py),
    with each rank's clock set to rank 0's before each apply."""

    share: Share = own_inputs
    gather: Gather = own_result
    on_clock: Callable[[float], None] | None = None


ONE_RANK = FanOut()


def busy(eng: Engine) -> bool:
    """Requests in flight, or cache ops whose results are still to apply."""
    return eng.has_work() or eng.kv.copies_pending()


def next_inputs(eng: Engine, inbox: Inbox) -> StepInputs:
    """What waits in the inbox (blocks up to IDLE_WAIT_S when idle), the clock now, and whether
    to step. The inbox holds NewRequest, Abort, Call and Stop."""
    items: list[InboxItem] = []
    try:
        items.append(inbox.get(timeout=IDLE_WAIT_S) if not busy(eng) else inbox.get_nowait())
        while True:
            items.append(inbox.get_nowait())
    except queue.Empty:
        pass
    new = [x for x in items if isinstance(x, NewRequest)]
    return StepInputs(
        new=new,
        aborts=[x.rid for x in items if isinstance(x, Abort)],
        clock=time.monotonic(),
        stop=any(isinstance(x, Stop) for x in items),
        step=busy(eng) or bool(new),
        calls=[x for x in items if isinstance(x, Call)],
    )


def run_steps(steps: StepLoop, inbox: Inbox | None) -> None:
    """The loop of every rank, one or many, until the inputs say stop: rank 0 (the one with an
    `inbox`) takes the inputs, the loop's fan-out gives every rank the same ones (and rank 0's
    clock), each applies them."""
    fan = steps.fan
    while True:
        msg = fan.share(next_inputs(steps.engine, inbox) if inbox is not None else None)
        if fan.on_clock is not None:
            fan.on_clock(msg.clock)
        if not steps.apply(msg):
            return


class StepLoop:
    """Applies step inputs to one engine and reports what happened (see the module doc)."""

    def __init__(
        self,
        engine: Engine,
        out: Out | None,
        fan: FanOut = ONE_RANK,
        events: KVEventPublisher | None = None,
        stats_every_s: float = 0.0,
        survive_errors: bool = False,
    ) -> None:
        """out: where this rank reports (None: a rank that does not); fan: how inputs and call
        results cross the ranks; survive_errors: an exception in a step fails the requests in
        flight and the loop goes on (one rank; under ranks it ends the run, as the ranks may be
        in different collectives)."""
        self.engine, self.out, self.fan, self.events = engine, out, fan, events
        self.stats_every_s, self.survive_errors = stats_every_s, survive_errors
        self.agree_s: list[float] = []  # durations of the step agreements (rank 0 reports them)
        self._admitted: set[str] = set()
        self._last_stats = float("-inf")
        engine.on_token = self._on_token

    def apply(self, msg: StepInputs) -> bool:
        """One iteration; False once the inputs said stop (everything in flight aborted)."""
        eng = self.engine
        for new in msg.new:
            self._submit(new)
        for call in msg.calls:
            self._call(call)
        aborts = eng.in_flight() if msg.stop else msg.aborts
        for rid in aborts:
            req = eng.abort(rid)
            if req is not None:
                self._ended(req)
        if msg.stop:
            return False
        result = self._step() if msg.step else eng.between_steps()
        if self.events is not None and (msg.step or aborts or msg.calls):  # a call may reset
            self.events.after_step(eng.cache, result)  # replay is served by its own thread
        if self.out is not None and msg.clock - self._last_stats >= self.stats_every_s:
            self._last_stats = msg.clock
            self.out(StatsOut(engine_stats(eng), list(self.agree_s)))
            self.agree_s.clear()
        return True

    def _submit(self, new: NewRequest) -> None:
        """Every rank builds the same request and submits it."""
        req = new.build()
        try:
            self.engine.submit(req)  # the same inputs on every rank: the same outcome
        except (ValueError, TypeError) as exc:
            self._report(Failed(req.rid, str(exc)))

    def _call(self, call: Call) -> None:
        """fn(engine) between steps; the reporting rank sends every rank's outcome."""
        try:
            mine: tuple[bool, Any] = (True, call.fn(self.engine))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, naming the rank
            mine = (False, exc if self.survive_errors else f"{type(exc).__name__}: {exc}")
        results = self.fan.gather(mine)
        if results is not None:
            self._report(CallDone(call.call_id, results))

    def _step(self) -> StepResult:
        """One engine step, its outcome reported; a failed step fails every request in flight
        (then its result is what happened to the cache around it)."""
        eng, start = self.engine, time.monotonic()
        try:
            result = eng.step()
        except Exception:  # noqa: BLE001 - one rank: fail the requests in flight, keep serving
            if not self.survive_errors:
                raise
            traceback.print_exc(file=sys.stderr)
            self._fail_all("internal error in an engine step")
            return eng.between_steps()
        # queue time ends once, at the first admission (also for one that ended in admission)
        for req in [*result.admitted, *result.ended]:
            if req.rid not in self._admitted:
                self._admitted.add(req.rid)
                self._report(Admitted(req.rid, dict(req.hits), start))
        for req in result.ended:
            self._ended(req)
        return result

    def _on_token(self, req: Request, tok: int) -> None:
        self._report(TokenOut(req.rid, tok))

    def _ended(self, req: Request) -> None:
        """A request ended on this rank: it is reported."""
        self._admitted.discard(req.rid)
        if req.failure is not None:  # a P/D hand-off failed: (status, message)
            self._report(Failed(req.rid, req.failure))
        else:  # spec_*: usage.spec on the HTTP side
            hits, spec = dict(req.hits), list(req.spec_accepts)
            done = Finished(
                req.rid, req.finish_reason, hits, req.transfer, spec, req.spec_proposed,
                req.pinned_pages,
            )  # fmt: skip
            self._report(done)

    def _fail_all(self, message: str) -> None:
        for rid in self.engine.in_flight():
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - already failing; the client still gets its error
                traceback.print_exc(file=sys.stderr)
            self._admitted.discard(rid)
            self._report(Failed(rid, message))

    def _report(self, msg: StepOutput) -> None:
        if self.out is not None:
            self.out(msg)

    def timed(self, agree: Callable[[list[int]], list[int]]) -> Callable[[list[int]], list[int]]:
        """The engine's agreement hook, timing each call (rank 0 reports the durations)."""

        def timed(local: list[int]) -> list[int]:
            t0 = time.perf_counter()
            agreed = agree(local)
            self.agree_s.append(time.perf_counter() - t0)
            return agreed

        return timed

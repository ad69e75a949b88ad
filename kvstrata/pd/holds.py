"""Prefill holds a hand-off's pages until they are sent (the engine's delayed free).

When a hand-off's request ends with its first token, the prefill connector's request_finished
answers True while the pages decode lacks are still to be read: the engine keeps the request's
lease open (its pages are neither freed, evicted nor reused) and the listener thread reads them
straight from the device pool when it sends them, once decode has asked. The listener then says
it is done with them here (sent, or the answer was dropped: cancelled, never asked for), and the
connector's next get_finished reports the request in `Finished.sent`: the engine frees its pages.

Under tp x pp ranks every rank holds the same request from the same step and sends its own part;
its pages go back on every rank at the same step, once every rank is done (HoldGate: "done here",
MIN over the ranks, a field of the step's one collective). Bounds: a hold still not done
pd_timeout_s after it began, on the engine's clock (the agreed one under ranks: every rank gives
up at the same step), is given up: counted (held_expired), logged naming the request, and its
pages go back. An abort of a held request (decode cancelled, the server stops) takes them back
at once. Either way the sink is dropped first, under its lock, so no read of the pages is under
way when they go back and none starts after.
"""

from __future__ import annotations

import queue
import sys
from typing import TYPE_CHECKING

from kvstrata.pd.metrics import RankCounts

if TYPE_CHECKING:
    from kvstrata.pd.sink import Sink


class Holds:
    """The hand-offs whose pages the engine holds for this rank's listener (engine thread,
    except `done`, which the listener thread calls)."""

    def __init__(self, timeout_s: float, metrics: RankCounts, gate: HoldGate | None = None) -> None:
        self.timeout_s, self.metrics, self.gate = timeout_s, metrics, gate
        self.held: dict[str, tuple[Sink, float]] = {}  # rid -> (sink, held since), in order
        self._done: queue.SimpleQueue[str] = queue.SimpleQueue()  # listener -> engine thread
        self.done_here: set[str] = set()  # held rids this rank's listener is done with
        if gate is not None:
            gate.holds = self

    def hold(self, sink: Sink, now: float) -> None:
        """The engine holds the pages of the sink's request from now (`now`: its clock)."""
        self.held[sink.req.rid] = (sink, now)

    def done(self, sink: Sink) -> None:
        """Listener thread: this rank reads the held sink's pages no more (said once per
        held answer: it was sent, or dropped unsent)."""
        self._done.put(sink.req.rid)

    def drop(self, rid: str) -> None:
        """An abort takes a held request's pages back now: no read of them is under way after
        this returns, and none starts."""
        got = self.held.pop(rid, None)
        if got is not None:
            got[0].drop()
            self.done_here.discard(rid)

    def collect(self) -> set[str]:
        """The held rids this rank's listener is done with, including what it said so far."""
        while True:
            try:
                self.done_here.add(self._done.get_nowait())
            except queue.Empty:
                return self.done_here

    def finished(self, now: float) -> list[str]:
        """The held requests whose pages go back this step, in the order they were held: done
        here (under ranks: done on every rank), or given up after timeout_s."""
        self.collect()
        agreed = self.gate.agreed_done() if self.gate is not None else self.done_here
        out = []
        for rid, (sink, since) in list(self.held.items()):
            if rid in agreed:
                out.append(rid)
            elif now - since > self.timeout_s:
                self._expire(sink, now - since)
                out.append(rid)
            else:
                continue
            del self.held[rid]
        self.done_here &= self.held.keys()  # a late word on a dropped hold is forgotten
        return out

    def _expire(self, sink: Sink, held_s: float) -> None:
        sink.drop()
        self.metrics.held_expired()
        print(
            f"kvstrata pd: hand-off {sink.hid} (request {sink.req.rid}): its pages were held "
            f"{held_s:.1f}s > pd_timeout_s={self.timeout_s} and never sent; released",
            file=sys.stderr,
            flush=True,
        )


class HoldGate:
    """The prefill ranks' agreement on which held pages go back, as fields of the step's one
    collective (kvstrata/ranks/rank_engine.py: RankEngine adds them to its all_reduce). Slot i
    is the i-th held request in holding order (the same list on every rank: every rank holds and
    lets go at the same steps); slots: how many holds are decided per step (the rest wait their
    turn)."""

    def __init__(self, slots: int) -> None:
        self.min_fields = tuple(f"held_done{i}" for i in range(slots))  # 1: done on this rank
        self.max_fields: tuple[str, ...] = ()
        self.holds: Holds | None = None
        self._window: list[str] = []
        self._agreed: set[str] = set()

    def local(self) -> dict[str, int]:
        assert self.holds is not None
        done = self.holds.collect()
        self._window = list(self.holds.held)[: len(self.min_fields)]
        return {
            f: int(i < len(self._window) and self._window[i] in done)
            for i, f in enumerate(self.min_fields)
        }

    def agreed(self, values: dict[str, int]) -> None:
        self._agreed = {rid for i, rid in enumerate(self._window) if values[self.min_fields[i]]}

    def agreed_done(self) -> set[str]:
        """Held requests done on every rank (this step's collective; used once)."""
        out, self._agreed = self._agreed, set()
        return out

"""Prefill pulls the held pages it lacks from decode, over the hand-off's own channel.

Decode's hand-off says it holds prompt pages [0, held). On one rank, a hand-off with held > 0
enters prefill's engine marked `remote`: its Lease matches, probes and prefetches over prefill's
own L1/L2/L3 and is admitted as any request's, but the engine does not plan its prompt yet. At
the first step after admission (the engine's connector calls step, here) the request's hits `have` are
known: with have >= held it goes on at once; else prefill asks decode for pages [have, held)
and waits, bounded by pd_timeout_s. The leading pulled pages that pass their checksums are
written into the request's own pages, which then count as computed and join the tree through
the same `cache_pages` / Lease.commit a computed chunk takes; the engine computes the rest
(a page that failed, every page after it, and the pages nobody held). No reply within
pd_timeout_s (decode died mid-pull): the request fails, its lease gives back every page.

Under tp x pp ranks (kvstrata/pd/ranks.py) every prefill rank runs the same request at the same
steps, so every rank asks its own decode peer for its own part of the same pages at the same
step. What each rank then does with its reply is not its own call: PullGate adds two fields per
pulling request to the step's one collective, "pages kept here" (MIN: a page that failed on any
rank is computed by every rank) and "silent here" (MAX: a rank whose peer never answered fails
the request on every rank, naming that rank). Each rank then lands the agreed pages through the
same `_land` (cache_pages -> Lease.commit) at the same step.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any

from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request, State
from kvstrata.pd.config import PDConfig
from kvstrata.pd.pages import write_pages
from kvstrata.pd.wire import Frames, pull_message, read_pulled

IDLE_WAIT_S = 0.005  # nothing to step but pulls: the engine thread waits this long for a reply
PULL_MARK = "decode"  # req.remote of a prefill hand-off that may pull held pages from decode


class Puller:
    """The engine-thread side of prefill's pulls (the connector's get_finished). The listener thread hands
    over new hand-offs through `new` and a pull's reply through `receive`.

    gate: a PullGate under several ranks (what to land is agreed, see the module docstring);
    None on one rank (the reply, or the wait running out, decides at once)."""

    def __init__(
        self, cfg: PDConfig, metrics: Any, send: Any, gate: PullGate | None = None, rank: int = 0
    ) -> None:
        self.cfg, self.metrics, self.gate, self.rank = cfg, metrics, gate, rank
        self.send = send  # send(sink, frames): queue a message for the listener thread
        self.new: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.sinks: dict[str, Any] = {}  # engine thread: rid -> Sink of a hand-off not yet going
        self.arrived = threading.Event()  # a pull's reply came (wakes an idle engine thread)

    def add(self, sink: Any) -> None:
        """Listener (one rank) or engine thread (ranks), before the request is submitted."""
        sink.req.remote = PULL_MARK
        self.new.put(sink)

    def receive(self, sink: Any, head: dict[str, Any], frames: Frames, page_bytes: int) -> None:
        """Listener thread: decode's `pulled` reply (page_bytes: this rank's part of a page).
        Only a reply asked for, and only the first one, is kept."""
        if sink is None or sink.asked is None or sink.reply is not None:
            return  # cancelled, answered, or not asked: nothing of it is used
        sink.reply = read_pulled(head, frames, page_bytes, sink.asked, sink.held)
        self.arrived.set()

    def step(self, engine: Engine) -> list[Request]:
        """Engine thread, once per step after admission; returns the requests it failed."""
        self.arrived.clear()  # a reply after this wakes the wait below at once
        while True:
            try:
                sink = self.new.get_nowait()
            except queue.Empty:
                break
            self.sinks[sink.req.rid] = sink
        finished: list[Request] = []
        for rid, sink in list(self.sinks.items()):
            req = sink.req
            if req.state is State.WAITING:
                continue  # its lease is still matching, probing L3 or waiting for room
            failure = None if req.state is State.DONE else self._advance(engine, sink)
            if req.state is State.DONE or not req.remote:
                del self.sinks[rid]  # ended (aborted), or going on in the engine
            elif failure is not None:
                del self.sinks[rid]
                self.metrics.failed()
                finished.append(engine.fail_remote(req, 504, failure))
        if self.sinks and _only_pulls(engine):
            self.arrived.wait(IDLE_WAIT_S)
        return finished

    def _advance(self, engine: Engine, sink: Any) -> str | None:
        """Ask, land, or keep waiting; the failure message once the wait ran out."""
        req = sink.req
        if sink.asked is None:
            have = engine.kv.hits(req).pages  # prefill's own tiers: L1, L2 and the shared L3
            if have >= sink.held:
                req.remote = ""  # nothing to pull: the engine computes the rest now
                return None
            sink.asked, sink.asked_s = have, engine.clock()  # ranks: the agreed clock
            self.send(sink, pull_message(sink.hid, have, sink.held))
            return None
        if self.gate is not None:
            verdict = self.gate.verdict(req.rid)
        elif sink.reply is not None:
            verdict = len(sink.reply[0])
        else:
            verdict = -1 if silent(sink, engine.clock(), self.cfg.pd_timeout_s) else None
        if verdict is None:
            return None
        if verdict < 0:  # -1 - r: decode's rank r (its peer here) never answered
            rank = f" rank {-1 - verdict}" if self.gate is not None else ""
            return (
                f"prefill waited pd_timeout_s={self.cfg.pd_timeout_s} for held pages "
                f"[{sink.asked}, {sink.held}) pulled from decode{rank}; none came"
            )
        self._land(engine, sink, verdict)
        return None

    def _land(self, engine: Engine, sink: Any, kept: int) -> None:
        """The first `kept` verified pages (every rank's part passed) into the request's own
        pages: computed from now on, and cached the way a computed chunk is (cache_pages ->
        Lease.commit)."""
        req, first = sink.req, sink.asked
        pages, why = sink.reply
        if kept < len(pages):
            why = f"pages [{first + kept}, {first + len(pages)}) failed on another rank"
        if why:  # not a failure: those pages are computed; said once, where it happened
            where = f" (rank {self.rank})" if self.gate is not None else ""
            print(f"kvstrata pd: {sink.hid}{where}: {why}; prefill computes them", file=sys.stderr)
        pages = pages[:kept]
        write_pages(engine.pool, req.page_table[first : first + kept], pages)
        req.computed = (first + kept) * engine.page
        if req.draft_computed is not None:
            req.draft_computed = req.computed  # a page carries its draft part, as a hit does
        engine.kv.cache_pages(req, final=False)
        sink.pulled = kept
        self.metrics.pulled("pull_received", kept, sum(p.nbytes for p in pages))
        req.remote = ""  # the engine computes the rest from here


def silent(sink: Any, now: float, timeout_s: float) -> bool:
    """The pull was asked more than timeout_s ago (now: the engine's clock) and no reply came."""
    return sink.reply is None and now - sink.asked_s > timeout_s


class PullGate:
    """The prefill ranks' decision on each pull, as fields of the step consensus (parallel/
    ranks.py: RankEngine adds them to its one all_reduce). Slot i is the i-th request waiting
    for its pull in `engine.running` (the same list on every rank: it changes only by agreed
    steps, and every rank asks at the same step); slots: max_running."""

    def __init__(self, slots: int, rank: int, timeout_s: float) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self.min_fields = tuple(f"pull_got{i}" for i in range(slots))  # 1 + pages kept here
        self.max_fields = tuple(f"pull_silent{i}" for i in range(slots))  # 1 + a silent rank
        self.engine: Any = None
        self.puller: Puller | None = None
        self._window: list[str] = []
        self._decided: dict[str, tuple[int, int]] = {}

    def local(self) -> dict[str, int]:
        """This rank's counts: 1 + the leading pages that passed here once its reply is in
        (else 0); 1 + this rank once its wait ran out on the agreed clock (else 0)."""
        assert self.engine is not None and self.puller is not None
        running = self.engine.running
        window = [r.rid for r in running if r.remote == PULL_MARK and r.state is State.PREFILL]
        self._window = window[: len(self.min_fields)]
        now, counts = self.engine.clock(), {}
        for i, (got, quiet) in enumerate(zip(self.min_fields, self.max_fields, strict=True)):
            sink = self.puller.sinks.get(self._window[i]) if i < len(self._window) else None
            asked = sink is not None and sink.asked is not None
            counts[got] = 1 + len(sink.reply[0]) if asked and sink.reply is not None else 0
            counts[quiet] = 1 + self.rank if asked and silent(sink, now, self.timeout_s) else 0
        return counts

    def agreed(self, values: dict[str, int]) -> None:
        self._decided = {
            rid: (values[self.min_fields[i]], values[self.max_fields[i]])
            for i, rid in enumerate(self._window)
        }

    def verdict(self, rid: str) -> int | None:
        """What every rank does this step: the pages to keep (>= 0), -1 - r (decode's rank r
        never answered: fail), or None (wait). Used once: later steps use their own agreement."""
        got, quiet = self._decided.pop(rid, (0, 0))
        if got:
            return got - 1
        return -quiet if quiet else None


def _only_pulls(engine: Engine) -> bool:
    """Every request in the engine waits for a pull, and no cache op is pending."""
    if engine.waiting or (engine.cache is not None and len(engine.cache.queues)):
        return False
    return all(r.remote and r.state is State.PREFILL for r in engine.running)

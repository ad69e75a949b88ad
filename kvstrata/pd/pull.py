"""Prefill pulls the held pages it lacks from decode, over the hand-off's own channel.

Decode's hand-off says it holds prompt pages [0, held). A hand-off's Lease matches, probes and
prefetches over prefill's own device/host/storage and is admitted as any request's. At admission its
hits `have` are known (the connector's get_num_new_matched_tokens): with have >= held it goes on at
once; else it waits for remote KV while prefill asks decode for pages [have, held), bounded by
pd_timeout_s. The leading pulled pages that pass their checksums are
written into the request's own pages, which then count as computed; the engine computes the rest
(a page that failed, every page after it, and the pages nobody held). A checksum proves the
bytes crossed intact, not that decode computed them honestly: the pulled pages, and every page
computed over them, serve this request only (Lease.keep_private: never in prefill's tree, its
host copies or the shared store), unless prefill is started with pd_trust_pulled; then they
join the tree through the same `cache_pages` / Lease.commit a computed chunk takes. No reply within
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

from kvstrata.engine.kv_connector import EngineView, Landed, RemoteDone, RemoteFailed
from kvstrata.engine.request import Request
from kvstrata.pd.config import PDConfig
from kvstrata.pd.pages import write_pages
from kvstrata.pd.wire import Frames, pull_message, read_pulled


class Puller:
    """Prefill's pulls, on the engine thread (the prefill connector drives it): which hand-off
    lacks held pages at admission, asking decode for them, and landing or failing the reply.
    New hand-offs come through `add` (the listener thread on one rank), replies through
    `receive` (the listener thread).

    gate: a PullGate under several ranks (what to land is agreed, see the module docstring);
    None on one rank (the reply, or the wait running out, decides at once)."""

    def __init__(
        self, cfg: PDConfig, metrics: Any, send: Any, gate: PullGate | None = None, rank: int = 0
    ) -> None:
        self.cfg, self.metrics, self.gate, self.rank = cfg, metrics, gate, rank
        self.send = send  # send(sink, frames): queue a message for the listener thread
        self.view: EngineView = None  # type: ignore[assignment]  # the prefill side's
        self.new: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.sinks: dict[str, Any] = {}  # engine thread: rid -> Sink of a hand-off not admitted
        self.asked: dict[str, Any] = {}  # rid -> Sink waiting for its pull, in asking order
        self.arrived = threading.Event()  # a pull's reply came (wakes an idle engine thread)

    def add(self, sink: Any) -> None:
        """Engine thread (the connector's add_request), before the scheduler has the request."""
        self.new.put(sink)

    def receive(self, sink: Any, head: dict[str, Any], frames: Frames, page_bytes: int) -> None:
        """Listener thread: decode's `pulled` reply (page_bytes: this rank's part of a page).
        Only a reply asked for, and only the first one, is kept."""
        if sink is None or sink.asked is None or sink.reply is not None:
            return  # cancelled, answered, or not asked: nothing of it is used
        sink.reply = read_pulled(head, frames, page_bytes, sink.asked, sink.held)
        self.arrived.set()

    def matched(self, req: Request, local_tokens: int) -> int:
        """At admission: prompt tokens of held pages prefill's own tiers (device, host and the
        shared storage: `local_tokens`) lack, which decode provides (0: nothing to pull)."""
        self._drain()
        sink = self.sinks.pop(req.rid, None)
        have = local_tokens // self.view.page_size
        if sink is None or have >= sink.held:
            return 0  # nothing to pull: the engine computes the rest now
        self.sinks[req.rid] = sink
        return (sink.held - have) * self.view.page_size

    def ask(self, req: Request, local_tokens: int) -> None:
        """Ask decode for held pages [have, held) (at admission, the same step on every rank)."""
        sink = self.sinks.pop(req.rid)
        sink.asked, sink.asked_s = local_tokens // self.view.page_size, self.view.clock()
        self.asked[req.rid] = sink
        self.send(sink, pull_message(sink.hid, sink.asked, sink.held))

    def _drain(self) -> None:
        while True:
            try:
                sink = self.new.get_nowait()
            except queue.Empty:
                return
            self.sinks[sink.req.rid] = sink

    def forget(self, req: Request) -> None:
        """The request ended: its pull, if any, is no longer waited for."""
        self._drain()
        self.sinks.pop(req.rid, None)
        self.asked.pop(req.rid, None)

    def finished(self, idle_wait_s: float) -> list[RemoteDone]:
        """Engine thread, once per step after admission: the pulls that landed or failed."""
        if idle_wait_s and self.asked:
            self.arrived.wait(idle_wait_s)  # only pulls to wait for: a reply wakes it at once
        self.arrived.clear()  # a reply after this wakes the next wait at once
        done: list[RemoteDone] = []
        for rid, sink in list(self.asked.items()):
            verdict = self._verdict(sink)
            if verdict is None:
                continue
            del self.asked[rid]
            if verdict >= 0:
                done.append(self._land(sink, verdict))
                continue
            rank = f" rank {-1 - verdict}" if self.gate is not None else ""
            self.metrics.failed()
            why = (
                f"prefill waited pd_timeout_s={self.cfg.pd_timeout_s} for held pages "
                f"[{sink.asked}, {sink.held}) pulled from decode{rank}; none came"
            )
            done.append(RemoteFailed(sink.req, 504, why))
        return done

    def _verdict(self, sink: Any) -> int | None:
        """Pages to keep (>= 0), -1 - r (decode's rank r never answered), or None (wait)."""
        if self.gate is not None:
            return self.gate.verdict(sink.req.rid)
        if sink.reply is not None:
            return len(sink.reply[0])
        return -1 if silent(sink, self.view.clock(), self.cfg.pd_timeout_s) else None

    def _land(self, sink: Any, kept: int) -> Landed:
        """The first `kept` verified pages (every rank's part passed) into the request's own
        pages: the engine counts them as computed and caches them the way a computed chunk is
        (cache_pages -> Lease.commit), then computes the rest."""
        first = sink.asked
        pages, why = sink.reply
        if kept < len(pages):
            why = f"pages [{first + kept}, {first + len(pages)}) failed on another rank"
        if why:  # not a failure: those pages are computed; said once, where it happened
            where = f" (rank {self.rank})" if self.gate is not None else ""
            print(f"kvstrata pd: {sink.hid}{where}: {why}; prefill computes them", file=sys.stderr)
        pages = pages[:kept]
        write_pages(self.view.pool, sink.pages[first : first + kept], pages)
        if kept and not self.cfg.pd_trust_pulled:  # decode may read this cache, not write it
            sink.req.lease.keep_private(first)  # these pages, and all computed over them
        sink.pulled = kept
        self.metrics.pulled("pull_received", kept, sum(p.nbytes for p in pages))
        return Landed(sink.req, (first + kept) * self.view.page_size)


def silent(sink: Any, now: float, timeout_s: float) -> bool:
    """The pull was asked more than timeout_s ago (now: the engine's clock) and no reply came."""
    return sink.reply is None and now - sink.asked_s > timeout_s


class PullGate:
    """The prefill ranks' decision on each pull, as fields of the step consensus (ranks/
    rank_engine.py: RankEngine adds them to its one all_reduce). Slot i is the i-th request waiting
    for its pull, in asking order (the same list on every rank: every rank asks at the same
    step, and it changes only by agreed steps); slots: max_running."""

    def __init__(self, slots: int, rank: int, timeout_s: float) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self.min_fields = tuple(f"pull_got{i}" for i in range(slots))  # 1 + pages kept here
        self.max_fields = tuple(f"pull_silent{i}" for i in range(slots))  # 1 + a silent rank
        self.puller: Puller | None = None
        self._window: list[str] = []
        self._decided: dict[str, tuple[int, int]] = {}

    def local(self) -> dict[str, int]:
        """This rank's counts: 1 + the leading pages that passed here once its reply is in
        (else 0); 1 + this rank once its wait ran out on the agreed clock (else 0)."""
        assert self.puller is not None
        asked = self.puller.asked
        self._window = list(asked)[: len(self.min_fields)]
        now, counts = self.puller.view.clock(), {}
        for i, (got, quiet) in enumerate(zip(self.min_fields, self.max_fields, strict=True)):
            sink = asked.get(self._window[i]) if i < len(self._window) else None
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

"""Prefill pulls the held pages it lacks from decode, over the hand-off's own channel.

Decode's hand-off says it holds prompt pages [0, held). On one rank, a hand-off with held > 0
enters prefill's engine marked `remote`: its Lease matches, probes and prefetches over prefill's
own L1/L2/L3 and is admitted as any request's, but the engine does not plan its prompt yet. At
the first step after admission (the engine's step hook, here) the request's hits `have` are
known: with have >= held it goes on at once; else prefill asks decode for pages [have, held)
and waits, bounded by pd_timeout_s. The leading pulled pages that pass their checksums are
written into the request's own pages, which then count as computed and join the tree through
the same `cache_pages` / Lease.commit a computed chunk takes; the engine computes the rest
(a page that failed, every page after it, and the pages nobody held). No reply within
pd_timeout_s (decode died mid-pull): the request fails, its lease gives back every page.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any

from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request, State
from kvstrata.pd.config import PDConfig
from kvstrata.pd.pages import write_pages
from kvstrata.pd.wire import pull_message

IDLE_WAIT_S = 0.005  # nothing to step but pulls: the engine thread waits this long for a reply
PULL_MARK = "decode"  # req.remote of a prefill hand-off that may pull held pages from decode


class Puller:
    """The engine-thread side of prefill's pulls (the step hook). The listener thread hands
    over new hand-offs through `new` and a pull's reply by setting `sink.reply`, then `arrived`."""

    def __init__(self, cfg: PDConfig, metrics: Any, send: Any) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.send = send  # send(sink, frames): queue a message for the listener thread
        self.new: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.sinks: dict[str, Any] = {}  # engine thread: rid -> Sink of a hand-off not yet going
        self.arrived = threading.Event()  # a pull's reply came (wakes an idle engine thread)

    def add(self, sink: Any) -> None:
        """Listener thread, before the request is submitted: it may pull."""
        sink.req.remote = PULL_MARK
        self.new.put(sink)

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
            have = req.lease.hits.pages  # prefill's own tiers: L1, L2 and the shared L3
            if have >= sink.held:
                req.remote = ""  # nothing to pull: the engine computes the rest now
                return None
            sink.asked, sink.asked_s = have, time.monotonic()
            self.send(sink, pull_message(sink.hid, have, sink.held))
            return None
        if sink.reply is not None:
            pages, why = sink.reply
            if why:  # not a failure: those pages are computed; said once, where it happened
                print(f"kvstrata pd: {sink.hid}: {why}; prefill computes them", file=sys.stderr)
            self._land(engine, sink, pages)
            return None
        if time.monotonic() - sink.asked_s <= self.cfg.pd_timeout_s:
            return None
        return (
            f"prefill waited pd_timeout_s={self.cfg.pd_timeout_s} for held pages "
            f"[{sink.asked}, {sink.held}) pulled from decode; none came"
        )

    def _land(self, engine: Engine, sink: Any, pages: list[Any]) -> None:
        """The verified leading pages into the request's own pages: computed from now on, and
        cached the way a computed chunk is (cache_pages -> Lease.commit)."""
        req, first = sink.req, sink.asked
        write_pages(engine.pool, req.page_table[first : first + len(pages)], pages)
        req.computed = (first + len(pages)) * engine.page
        if req.draft_computed is not None:
            req.draft_computed = req.computed  # a page carries its draft part, as a hit does
        engine.admission.cache_pages(req, final=False)
        sink.pulled = len(pages)
        self.metrics.pulled("pull_received", len(pages), sum(p.nbytes for p in pages))
        req.remote = ""  # the engine computes the rest from here


def _only_pulls(engine: Engine) -> bool:
    """Every request in the engine waits for a pull, and no cache op is pending."""
    if engine.waiting or (engine.cache is not None and len(engine.cache.queues)):
        return False
    return all(r.remote and r.state is State.PREFILL for r in engine.running)

"""The scheduler: who waits, who runs, and what each running request feeds the next forward.

It owns the waiting and running lists. Admission goes through the KV manager (the one owner of
every lease); the batch is planned under the token budget (decodes first, then prefill chunks)
and any further budget term (`BatchLimit`: CP's gather scratch bytes), with requests dropped
from the end of the plan until it fits. Preemption, prefix-cache reset and abort change these
lists too, so they live here. Every decision reads agreed state only: all ranks plan alike.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvstrata.engine.config import EngineConfig
from kvstrata.engine.kv_manager import KVManager
from kvstrata.engine.request import Request, State

RESET_DRAIN_S = 120.0  # a prefix-cache reset waits this long at most for copies in flight

Work = list[tuple[Request, list[int]]]
"""A planned batch: each running request and the tokens it feeds this forward."""


class BatchLimit(Protocol):
    """A budget term beyond the token count (kvstrata.parallel.cp.ScratchBudget)."""

    def fits(self, work: Work) -> bool:
        """Whether this batch stays within the term."""
        ...

    def planned(self, work: Work) -> None:
        """The batch that will run (a term may keep its peak)."""
        ...


@dataclass
class Scheduled:
    """One step's schedule: who was admitted, who the connector ended, what the forward runs."""

    admitted: list[Request] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)
    work: Work = field(default_factory=list)


class Scheduler:
    """Waiting and running requests of one engine, planned under the step's budget."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVManager,
        limit: BatchLimit | None = None,
        speculating: bool = False,
    ) -> None:
        self.config, self.kv, self.limit = config, kv, limit
        self.speculating = speculating  # hit pages bring their draft part along
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self, now_s: float, poll: Callable[[], list[Request]] | None = None) -> Scheduled:
        """Admit what is ready and fits, let `poll` land or fail remote work (it returns the
        requests it ended), then plan the forward."""
        failed: dict[str, str] = {}
        out = Scheduled(admitted=self._admit(now_s, failed))
        out.ended = [self._fail_waiting(rid, why) for rid, why in failed.items()]
        out.ended += poll() if poll is not None else []
        out.work = self._plan()
        return out

    def _fail_waiting(self, rid: str, why: str) -> Request:
        """A waiting request whose lease work raised ends alone with a 500."""
        req = next(r for r in self.waiting if r.rid == rid)
        return self.fail(req, 500, f"request {rid} failed in admission: {why}")

    def _admit(self, now_s: float, failed: dict[str, str]) -> list[Request]:
        slots = self.config.max_running - len(self.running)
        admitted = self.kv.advance(self.waiting, now_s, slots, failed)
        for req in admitted:
            self.waiting.remove(req)
            self.running.append(req)
            if self.speculating:
                req.draft_computed = req.computed
        return admitted

    def _plan(self) -> Work:
        """Tokens each running request feeds this step: decodes first, then prefill chunks,
        trimmed from the end until every budget term fits (the first item always runs)."""
        budget = self.config.max_batch_tokens
        work: Work = []
        for req in self.running:
            if req.state is State.DECODE and budget:
                work.append((req, [req.output[-1]]))
                budget -= 1
        for req in self.running:
            if req.state is State.PREFILL and budget and not req.remote:
                seq = req.prefill_tokens
                cap = self.config.chunk_tokens or budget  # 0: no cap but the budget
                n = min(cap, len(seq) - req.computed, budget)
                work.append((req, seq[req.computed : req.computed + n]))
                budget -= n
        limit = self.limit
        if limit is not None:
            while len(work) > 1 and not limit.fits(work):
                work.pop()
            if work:
                limit.planned(work)
        return work

    # ---- endings --------------------------------------------------------------------------------
    def finish(self, req: Request, reason: str) -> Request:
        """A running request ends: its full pages stay cached, the rest goes back."""
        self.kv.cache_pages(req, final=True)
        self.running.remove(req)
        return ended(req, reason)

    def fail(self, req: Request, status: int, message: str) -> Request:
        """A running request whose own work failed (its remote prefill, its sampling, anything
        one request raised in a step): its computed full pages are cached, the client gets
        `status` and `message` (the loop reads req.failure). Its batch mates are untouched."""
        req.failure = (status, message)
        if req in self.waiting:  # failed while waiting (its lease's match or probe)
            self.waiting.remove(req)
            self.kv.abort(req)
            return ended(req, "error")
        if req not in self.running:  # it had ended already (it raised after its finish)
            return ended(req, "error")
        try:
            return self.finish(req, "error")
        except Exception:  # noqa: BLE001 - its lease work itself failed: give back, cache nothing
            traceback.print_exc(file=sys.stderr)
            if req in self.running:
                self.running.remove(req)
            self.kv.abort(req)
            return ended(req, "error")

    def abort(self, rid: str) -> Request | None:
        """End a waiting or running request now, releasing its pages and locks at once (a
        running one's computed full pages stay cached, like a finished request's); None when no
        such request is in flight."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.kv.abort(req)
                return ended(req, "abort")
        for req in self.running:
            if req.rid == rid:
                return self.finish(req, "abort")
        return None

    # ---- preemption and prefix-cache reset ------------------------------------------------------
    def preempt_running(self) -> int:
        """Every running request back to the head of the queue (vLLM's recompute preemption);
        `req.hits` is kept, so its usage keeps its first admission's hits. Returns how many."""
        n = len(self.running)
        for req in reversed(self.running):
            self.kv.preempt(req)
            self.waiting.insert(0, req)
        self.running.clear()
        return n

    def reset_prefix_cache(
        self, reset_running: bool, drop_host: bool, settle: Callable[[], bool]
    ) -> bool:
        """Forget every cached L1 page (drop_host: L2 too; never L3). False, changing nothing,
        while requests run and reset_running is off, or while remote work is in flight (its
        pages are being written by another worker: it cannot be preempted). `settle` applies
        the agreed finished copies (the same call on every rank); True when some landed."""
        cache = self.kv.cache
        if cache is None:
            return True
        if self.running and (not reset_running or any(r.remote for r in self.running)):
            return False
        self.preempt_running()
        for req in self.waiting:  # waiting leases let go of their locks; they match again later
            self.kv.release(req)
        deadline = time.monotonic() + RESET_DRAIN_S
        while len(cache.queues):  # every copy lands (agreed: the same loop on every rank)
            if not settle():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"prefix-cache reset: {len(cache.queues)} cache copies still pending "
                        f"after {RESET_DRAIN_S:g} s"
                    )
                time.sleep(0.0005)
        return cache.reset_prefix(drop_host)


def ended(req: Request, reason: str) -> Request:
    req.state = State.DONE
    req.finish_s = time.monotonic()
    req.finish_reason = reason
    return req

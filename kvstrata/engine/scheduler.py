"""The scheduler: who waits, who runs, and what each running request feeds the next forward.

It owns the waiting and running lists, every change of a request's state (waiting -> prefill
or waiting for remote KV -> decode -> done, back to waiting on preemption) and the admission
policy; the KV manager only answers whether a request's pages are ready and can be had (the one
owner of every lease). The batch is planned under the token budget (decodes first, then prefill
chunks in the prefill order: kvstrata.engine.prefill_order; a smaller budget while requests
decode: `EngineConfig.decode_step_tokens` in tokens, and `EngineConfig.tpot_target_ms` in time,
from step costs learnt online) and any further budget term (`BatchLimit`: CP's gather scratch
bytes), with requests dropped from the end of the plan until it fits. Every decision reads
agreed state only: all ranks plan alike.

A request that arrived since the last step asks storage before the step's agreement
(`probe_arrivals`), so an answer that comes in time is applied in that step and the request is
admitted in it, not one forward later.

Admission without head-of-line blocking: the first `admission_lookahead` waiting requests advance
their leases (match, storage probe, prefetch) at once; a request still waiting on storage is
passed over, and the ready ones behind it are admitted in arrival order while slots and pages
last. Among ready requests admission stays first come first served: a ready request that does
not fit stops the scan, so a large request is not starved by small ones behind it, and the
leases behind it let go of their locks so they cannot keep it out for ever.

Delayed free (vLLM's shape): an ended request whose connector still reads its pages
(request_finished returned True) is held: its lease stays open (the pages it committed stay
locked in the tree, the rest stay its own: none is freed, evicted or reused) until the
connector reports it in `Finished.sent`, or an abort takes the pages back. A held request is
no longer running; the scheduler keeps stepping while one is held.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Protocol

from kvstrata.cache.ops import TransferOp
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.kv_connector import ConnectorMeta, KVConnector, RemoteDone
from kvstrata.engine.kv_manager import KVManager
from kvstrata.engine.prefill_order import PREFILL_ORDERS, PrefillOrder, tokens_left
from kvstrata.engine.request import Request, State
from kvstrata.engine.step_costs import StepCosts

IDLE_REMOTE_WAIT_S = 0.005  # only remote KV to wait for: the connector may block this long

Work = list[tuple[Request, list[int]]]
"""A planned batch: each running request and the tokens it feeds this forward."""


class BatchLimit(Protocol):
    """A budget term beyond the token count (kvstrata.ranks.scratch_budget.ScratchBudget)."""

    def fits(self, work: Work) -> bool:
        """Whether this batch stays within the term."""
        ...

    def planned(self, work: Work) -> None:
        """The batch that will run (a term may keep its peak)."""
        ...


@dataclass
class Scheduled:
    """One step's schedule. `admit` fills who was admitted, who ended in admission and what
    the connector says landed or failed (the engine applies those); `plan` fills what the
    forward runs and the connector's metadata for it."""

    admitted: list[Request] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)
    remote: list[RemoteDone] = field(default_factory=list)
    work: Work = field(default_factory=list)
    meta: ConnectorMeta = field(default_factory=ConnectorMeta)


@dataclass(frozen=True)
class QueueDepths:
    """The scheduler's queues by length (stats and debug answers read these, not its lists)."""

    waiting: int
    running: int
    held: int  # ended; pages held for their connector


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
        self.arrived: list[Request] = []  # added since the last step's probe_arrivals
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # ended; its connector still reads its pages
        self.connector: KVConnector | None = None  # remote KV at fixed points (connector.py)
        self.costs = StepCosts()  # learnt from the planned steps' durations (tpot_target_ms)
        self._last: tuple[float, int, int] | None = None  # last plan: (start, decodes, prefill)
        self._prefill_order: PrefillOrder = PREFILL_ORDERS.get(config.prefill_order)
        self._passed_over: set[str] = set()  # prompts the last plan gave no tokens

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.arrived.append(req)

    def probe_arrivals(self) -> list[TransferOp]:
        """The requests that arrived since the last step and sit in the admission window ask
        storage now (KVManager.probe_ahead); returns the probes put. One whose lease work
        raises is left to its admission, which raises the same and ends it alone."""
        if not self.arrived:
            return []
        window = {r.rid for r in self.waiting[: self.config.admission_lookahead]}
        arrived, self.arrived = self.arrived, []
        probes = []
        for req in arrived:
            if req.rid not in window:
                continue
            try:
                op = self.kv.probe_ahead(req)
            except Exception:  # noqa: BLE001 - reported by its admission (Scheduler._admit)
                continue
            if op is not None:
                probes.append(op)
        return probes

    def depths(self) -> QueueDepths:
        """How many requests wait, run, and are held (plain integers)."""
        return QueueDepths(len(self.waiting), len(self.running), len(self.held))

    def has_work(self) -> bool:
        """Requests to step, or held pages whose connector report is still to come."""
        return bool(self.waiting or self.running or self.held)

    # ---- one step: admit, (the engine applies the remote results), plan ------------------------
    def admit(self, now_s: float) -> Scheduled:
        """Admit what is ready and fits (asking the connector for remote tokens) and take what
        the connector says landed or failed. A request whose own admission work raised ends
        alone."""
        self._observe(now_s)
        failed: dict[str, str] = {}
        out = Scheduled(admitted=self._admit(now_s, failed))
        out.ended = [self._fail_waiting(rid, why) for rid, why in failed.items()]
        conn = self.connector
        if conn is not None:
            got = conn.get_finished(IDLE_REMOTE_WAIT_S if self._only_remote() else 0.0)
            out.remote = got.remote
            for rid in got.sent:
                self._free_held(rid)
        return out

    def _free_held(self, rid: str) -> None:
        """The connector reads a held request's pages no more: they go back now (its
        committed pages stay cached, unlocked)."""
        req = self.held.pop(rid, None)
        assert req is not None, f"the connector reported {rid} sent, which is not held"
        self.kv.free(req)

    def plan(self, now_s: float, out: Scheduled) -> Scheduled:
        """Plan the forward (after the remote results were applied) and build the connector's
        metadata for it."""
        out.work = self._plan()
        self._planned(now_s, out.work)
        if self.connector is not None:
            out.meta = self.connector.build_connector_meta(out.work)
        return out

    def _fail_waiting(self, rid: str, why: str) -> Request:
        """A waiting request whose lease work raised ends alone with a 500."""
        req = next(r for r in self.waiting if r.rid == rid)
        return self.fail(req, 500, f"request {rid} failed in admission: {why}")

    def _admit(self, now_s: float, failed: dict[str, str]) -> list[Request]:
        """Up to the free slots of ready requests that fit, in arrival order (module doc).
        failed: rid -> why, for requests whose own lease work raised."""
        self.kv.begin_step(now_s)
        slots = self.config.max_running - len(self.running)
        admitted: list[Request] = []
        window = self.waiting[: self.config.admission_lookahead]
        for i, req in enumerate(window):
            try:
                ready = self.kv.ready(req, now_s, can_schedule=slots > 0)
            except Exception as exc:  # noqa: BLE001 - one request's lease fails alone
                failed[req.rid] = f"{type(exc).__name__}: {exc}"
                continue
            if not ready:
                continue  # waiting on storage: the ready requests behind it go first
            if slots <= 0:
                break
            got = self.kv.allocate(req)
            if got is None:
                self._step_back(window[i + 1 :])
                break
            req.computed = got.hit_tokens  # its hits count as computed
            req.pinned_pages = max(req.pinned_pages, got.pinned_pages)
            req.state = State.PREFILL
            admitted.append(req)
            slots -= 1
        for req in admitted:  # after the scan: the connector hears of them in arrival order
            self._run(req)
        return admitted

    def _step_back(self, behind: list[Request]) -> None:
        """The first ready request does not fit: the leases behind it give back their locks
        (and stop their prefetches), so the pages they pinned can make room for it. They match
        again from scratch at a later step; without this, waiting leases that lock each other's
        room would wait for ever."""
        for req in behind:
            self.kv.release(req)

    def _run(self, req: Request) -> None:
        """An admitted request runs; tokens another worker provides, if any, make it wait for
        them (its pages stay allocated)."""
        self.waiting.remove(req)
        self.running.append(req)
        if self.speculating:
            req.draft_computed = req.computed
        if self.connector is not None:
            self._match_remote(self.connector, req)

    def _match_remote(self, conn: KVConnector, req: Request) -> None:
        """After the local match and allocation: tokens another worker provides, if any."""
        remote = conn.get_num_new_matched_tokens(req, req.computed)
        conn.update_state_after_alloc(req, self.kv.page_table(req), remote)
        if remote:
            req.state = State.WAITING_FOR_REMOTE_KV

    def _only_remote(self) -> bool:
        """Every request in flight waits for remote KV (none may run: only held pages wait
        for their connector), and no cache op is pending."""
        if self.waiting or self.kv.copies_pending():
            return False
        return all(r.state is State.WAITING_FOR_REMOTE_KV for r in self.running)

    def _observe(self, now_s: float) -> None:
        """The last planned step's duration, from its schedule to this one, feeds the step
        costs, unless the engine may have idled in between (nothing was left running)."""
        last, self._last = self._last, None
        if last is not None and self.running:
            start, decodes, prefill = last
            self.costs.observe(decodes, prefill, now_s - start)

    def _planned(self, now_s: float, work: Work) -> None:
        decodes = sum(1 for req, _ in work if req.state is State.DECODE)
        prefill = sum(len(toks) for req, toks in work if req.state is not State.DECODE)
        self._last = (now_s, decodes, prefill) if work else None

    def _prefill_budget(self, budget: int, decodes: int) -> int:
        """Prefill tokens a step may carry beside its `decodes`: the token budget's rest, less
        while requests decode (the decode-latency budget in tokens, the target in time)."""
        cfg = self.config
        if not decodes:
            return budget
        if cfg.decode_step_tokens:
            budget = min(budget, max(0, cfg.decode_step_tokens - decodes))
        if cfg.tpot_target_ms:
            room = self.costs.prefill_room(cfg.tpot_target_ms / 1000, cfg.tpot_min_prefill_tokens)
            budget = budget if room is None else min(budget, room)
        return budget

    def _plan(self) -> Work:
        """Tokens each running request feeds this step: decodes first, then prefill chunks in
        the prefill order, trimmed from the end until every budget term fits (the first item
        always runs)."""
        budget = self.config.max_batch_tokens
        work: Work = []
        for req in self.running:
            if req.state is State.DECODE and budget:
                work.append((req, [req.output[-1]]))
                budget -= 1
        budget = self._prefill_budget(budget, len(work))
        prefilling = [r for r in self.running if r.state is State.PREFILL]
        for req in self._prefill_order(prefilling, self._passed_over):
            if budget:
                cap = self.config.chunk_tokens or budget  # 0: no cap but the budget
                n = min(cap, tokens_left(req), budget)
                work.append((req, req.prefill_tokens[req.computed : req.computed + n]))
                budget -= n
        limit = self.limit
        if limit is not None:
            while len(work) > 1 and not limit.fits(work):
                work.pop()
            if work:
                limit.planned(work)
        planned = {req.rid for req, _ in work}
        self._passed_over = {r.rid for r in prefilling if r.rid not in planned}
        return work

    # ---- transitions the engine's results call for ------------------------------------------
    def resume_remote(self, req: Request) -> None:
        """The request's remote KV landed (or nothing came): it prefills from here on."""
        assert req.state is State.WAITING_FOR_REMOTE_KV, f"{req.rid} waits for no remote KV"
        req.state = State.PREFILL

    def first_token(self, req: Request) -> None:
        """A prefilling request produced a token: it decodes from now on."""
        req.first_token_s = time.monotonic()
        req.state = State.DECODE

    def caught_up(self, req: Request) -> None:
        """A preempted request recomputed its prompt and output: its next step feeds its
        last token, as before the preemption."""
        req.state = State.DECODE

    # ---- endings --------------------------------------------------------------------------------
    def finish(self, req: Request, reason: str) -> Request:
        """A running request ends: its full pages stay cached; the rest goes back, unless its
        connector still reads them (then the request is held: module doc)."""
        self.kv.cache_pages(req, final=False)
        keep = self.connector is not None and self.connector.request_finished(req)
        self.running.remove(req)
        if keep:
            self.held[req.rid] = req
        else:
            self.kv.free(req)
        return ended(req, reason)

    def fail(self, req: Request, status: int, message: str) -> Request:
        """A running request whose own work failed (its remote KV, its sampling, anything one
        request raised in a step): its computed full pages are cached, the client gets
        `status` and `message` (the loop reads req.failure). Its batch mates are untouched."""
        req.failure = (status, message)
        if req in self.waiting:  # failed while waiting (its lease's match or probe)
            self.waiting.remove(req)
            self._tell_gone(req)
            self.kv.free(req)
            return ended(req, "error")
        if req not in self.running:  # it had ended already (it raised after its finish)
            return ended(req, "error")
        try:
            return self.finish(req, "error")
        except Exception:  # noqa: BLE001 - its lease work itself failed: give back, cache nothing
            traceback.print_exc(file=sys.stderr)
            if req in self.running:
                self.running.remove(req)
            self._tell_gone(req)  # its remote KV, if any, is no longer awaited
            self.kv.free(req)
            return ended(req, "error")

    def _tell_gone(self, req: Request) -> None:
        """The connector hears of a request whose pages go back now whatever it answers (it
        ended waiting, or its own lease work failed): a request it would keep is dropped."""
        conn = self.connector
        if conn is not None and conn.request_finished(req):
            conn.drop_held(req)

    def abort(self, rid: str) -> Request | None:
        """End a waiting or running request now, releasing its pages and locks at once (a
        running one's computed full pages stay cached, like a finished request's); None when no
        such request is in flight. A held request (ended already) gives its pages back at once:
        its connector stops reading them first; None too."""
        held = self.held.pop(rid, None)
        if held is not None:
            assert self.connector is not None, "only a connector's requests are held"
            self.connector.drop_held(held)
            self.kv.free(held)
            return None
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._tell_gone(req)
                self.kv.free(req)
                return ended(req, "abort")
        for req in self.running:
            if req.rid == rid:
                return self.finish(req, "abort")
        return None

    # ---- preemption and prefix-cache reset ------------------------------------------------------
    def preempt_running(self) -> int:
        """Every running request back to the head of the queue (vLLM's recompute preemption):
        readmitted, it recomputes its prompt and the tokens it made so far. Returns how many."""
        n = len(self.running)
        for req in reversed(self.running):
            self.kv.preempt(req)
            req.computed, req.draft_computed = 0, None
            req.state = State.WAITING
            self.waiting.insert(0, req)
        self.running.clear()
        return n

    def clear_for_reset(self, reset_running: bool) -> bool:
        """Before a prefix-cache reset: running requests back to waiting, waiting leases let go
        of their locks (they match again later). False, changing nothing, while requests run
        and reset_running is off, or while remote work is in flight (its pages are being
        written or read by another worker: it cannot be preempted)."""
        remote = bool(self.held) or any(
            r.state is State.WAITING_FOR_REMOTE_KV for r in self.running
        )
        if remote or (self.running and not reset_running):
            return False
        self.preempt_running()
        for req in self.waiting:
            self.kv.release(req)
        return True


def ended(req: Request, reason: str) -> Request:
    req.state = State.DONE
    req.finish_s = time.monotonic()
    req.finish_reason = reason
    return req

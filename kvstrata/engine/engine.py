"""The reference serving engine: continuous batching with chunked prefill over the tiered cache.

One `step()` reads like nano-vllm's: the requests that arrived since the last step ask storage
(`scheduler.probe_arrivals()`), agree on and apply finished cache moves (those answers among
them, when they came within `probe_wait_ms`), then `scheduler.admit()` (waiting requests whose
pages the KV manager can give), apply what the connector says landed or failed,
`scheduler.plan()` (decodes and prefill chunks under the budget), `runner.run()` (one forward:
logits rows), `postprocess()` (sample, verify drafts, cache finished pages, end what is
complete). It returns a StepResult: who was admitted and who ended,
and the pages its requests cached (the KV event publisher's tokens and salts).
The scheduler makes every change of a request's state; the engine tells it what the forward and
the connector produced.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvstrata.cache.hicache import HiCache
from kvstrata.cache.keys import as_token_array
from kvstrata.cache.lease import LeaseState
from kvstrata.cache.ops import TransferOp
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.kv_connector import EngineView, KVConnector, Landed, RemoteDone, RemoteFailed
from kvstrata.engine.kv_manager import KVManager
from kvstrata.engine.request import Request, State
from kvstrata.engine.runner import Forward, ModelRunner
from kvstrata.engine.scheduler import BatchLimit, QueueDepths, Scheduler, Work
from kvstrata.engine.speculative import Speculator
from kvstrata.engine.step_result import StepResult
from kvstrata.memory.pool import DevicePool
from kvstrata.model.decoder import DecoderLM

RESET_DRAIN_S = 120.0  # a prefix-cache reset waits this long at most for copies in flight

Agree = Callable[[list[int]], list[int]]
"""Turns this rank's cache progress vector into the agreed one (identity on one rank)."""


class DecisionSink(Protocol):
    """Where a rank logs its cache decisions per step (kvstrata.ranks.decision_log.DecisionLog)."""

    def begin_step(self, step: int) -> None: ...

    def should_skip(self, step: int | None = None) -> bool: ...

    def record(self, kind: str, **payload: Any) -> bool: ...

    def end_step(self, step: int | None = None) -> int: ...


def _hold_back_one(agreed: list[int]) -> list[int]:
    """The agreed vector minus its last applicable completion (a deliberately skipped decision)."""
    out = list(agreed)
    done = [i for i, v in enumerate(out) if v >= 0]
    if done:
        out[done[-1]] = -1
    return out


class Engine:
    """Runs requests to completion on one model, one device pool and (optionally) the cache."""

    def __init__(
        self,
        model: DecoderLM,
        pool: DevicePool,
        cache: HiCache | None,
        kv: KVManager,
        config: EngineConfig,
        agree: Agree | None = None,
        clock: Callable[[], float] = time.monotonic,
        decisions: DecisionSink | None = None,
        speculator: Speculator | None = None,
        limit: BatchLimit | None = None,
    ) -> None:
        """limit: a budget term beyond the token count (CP: the gather's scratch bytes)."""
        self.model, self.pool, self.cache, self.config = model, pool, cache, config
        self.spec = speculator  # None: plain decoding
        self.kv = kv
        self.scheduler = Scheduler(config, kv, limit, speculating=speculator is not None)
        self.runner = ModelRunner(model, pool, kv, speculator)
        self.agree = agree or (lambda v: v)
        # decisions (prefetch budgets) read `clock`: under several ranks an agreed clock (rank 0's
        # time, broadcast); TTFT and other metrics read this rank's wall time
        self.clock = clock
        self.decisions = decisions
        self.page = pool.shape.page_size
        self.steps = 0
        self.prompt_tokens = 0  # prompt tokens this engine's forwards computed (not hits/pulls)
        self.on_token: Callable[[Request, int], None] | None = None
        """Called with each token as it is produced (the server streams from it)."""
        self.connector: KVConnector | None = None
        """Remote KV in and out at fixed points of the step (P/D;
        kvstrata/engine/kv_connector.py)."""

    def use_connector(self, conn: KVConnector) -> None:
        """Remote KV through `conn` from now on (the scheduler and runner call it)."""
        conn.register_kv_caches(EngineView(self.pool, self.kv, self.clock, self.spec))
        self.connector = self.scheduler.connector = conn

    def queue_depths(self) -> QueueDepths:
        """How many requests wait, run, and are held."""
        return self.scheduler.depths()

    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    # ---- API ----------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request; ValueError / TypeError naming what is wrong with it (its connector
        hears of it first, and of its refusal: request_finished with req.failure)."""
        conn = self.connector
        if conn is not None:
            conn.add_request(req)
        try:
            self._check(req)
        except (ValueError, TypeError) as exc:
            if conn is not None:
                req.failure = (400, str(exc))
                conn.request_finished(req)
            raise
        req.arrival_s = time.monotonic()  # metrics use this rank's wall time
        self.scheduler.add(req)

    def _check(self, req: Request) -> None:
        if not req.tokens:
            raise ValueError(f"request {req.rid}: empty prompt")
        as_token_array(req.tokens, self.model.vocab_size)  # ids in range, integers
        limit = self.model.spec.max_position_embeddings
        # the last generated token is never fed back: it needs no position of its own
        if len(req.tokens) + req.max_new_tokens - 1 > limit:
            raise ValueError(
                f"request {req.rid}: {len(req.tokens)} prompt + {req.max_new_tokens} new "
                f"tokens exceed the model's {limit} positions"
            )
        if req.max_new_tokens < 1:
            raise ValueError(f"request {req.rid}: max_new_tokens must be >= 1")
        if req.pages_needed(self.page) > self.pool.capacity:
            raise ValueError(
                f"request {req.rid} needs {req.pages_needed(self.page)} pages; "
                f"the device pool holds {self.pool.capacity}"
            )

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def in_flight(self) -> list[str]:
        """Ids of every request not ended yet, waiting ones first (the same order on every
        rank: a stop aborts them in it)."""
        return [r.rid for r in [*self.scheduler.waiting, *self.scheduler.running]]

    def run(self, requests: list[Request]) -> list[Request]:
        """Submit and run to completion; returns the requests in the order they ended."""
        for req in requests:
            self.submit(req)
        done: list[Request] = []
        while self.has_work():
            done += self.step().ended
        return done

    def step(self) -> StepResult:
        """One scheduler step: who was admitted in it and who ended (finished or failed)."""
        self.steps += 1
        log = self.decisions
        if log is not None:
            log.begin_step(self.steps)
        self._settle(self.scheduler.probe_arrivals())
        now = self.clock()
        batch = self.scheduler.admit(now)
        self._admitted(batch.admitted)
        finished = batch.ended + self._land_remote(batch.remote)
        self.scheduler.plan(now, batch)
        if batch.work:
            conn = self.connector
            if conn is not None:
                conn.bind_connector_metadata(batch.meta)
            layers = conn if conn is not None and batch.meta.per_layer else None
            finished += self.postprocess(batch.work, self.runner.run(batch.work, layers))
            if conn is not None:
                conn.clear_connector_metadata()
        if log is not None:
            for req in finished:
                log.record("finish", rid=req.rid, cached_pages=len(req.page_table))
            log.end_step(self.steps)
        if not batch.work:
            time.sleep(0.0005)  # only waiting on copies or storage: don't spin hot
        return StepResult(batch.admitted, finished, self.kv.take_cached())

    def between_steps(self) -> StepResult:
        """What happened to the cache outside a step since the last result was taken (an
        abort's or a call's last commit): the pages cached; who ended there is the abort's or
        the call's own answer."""
        return StepResult(cached=self.kv.take_cached())

    def _settle(self, probes: list[TransferOp]) -> bool:
        """Apply the finished cache moves every rank agrees on, once this rank's answers to
        `probes` (asked this step) are in or probe_wait_ms passed; True when some were applied."""
        if self.cache is None:
            return False
        if probes and self.config.probe_wait_ms:
            self.cache.await_answers(probes, self.config.probe_wait_ms / 1000)
        log = self.decisions
        agreed = self.agree(self.cache.local_progress())
        if log is not None and log.should_skip(self.steps):
            agreed = _hold_back_one(agreed)  # injected divergence: this rank skips a decision
        applied = self.cache.apply(agreed)
        self.kv.landed(applied)
        if log is not None and applied:
            log.record("apply", ops=[x for op in applied for x in (op.kind, op.agreed, op.pages)])
        return bool(applied)

    def _admitted(self, admitted: list[Request]) -> None:
        for req in admitted:
            if self.decisions is not None:
                self.decisions.record(
                    "admit",
                    rid=req.rid,
                    pages=req.page_table,
                    hits=[req.hits["device"], req.hits["host"], req.hits["storage"]],
                )

    def abort(self, rid: str) -> Request | None:
        """End a waiting or running request now (see Scheduler.abort); None when unknown."""
        return self.scheduler.abort(rid)

    def spec_stats(self) -> dict[str, float] | None:
        """Speculative decoding figures over every request so far (None when it is off)."""
        return self.spec.stats.as_dict() if self.spec is not None else None

    def drain(self) -> None:
        """Apply every pending cache op (shutdown, tests), agreed: the cache's one drain loop."""
        if self.cache is not None:
            self.kv.landed(self.cache.drain(self.agree))

    # ---- remote KV (the connector's landed / failed requests) --------------------------------
    def _land_remote(self, done: list[RemoteDone]) -> list[Request]:
        """Resume what landed, end what failed (in the connector's order); returns the ended."""
        ended: list[Request] = []
        for item in done:
            req = item.req
            assert req.state is State.WAITING_FOR_REMOTE_KV, f"{req.rid} waits for no remote KV"
            if isinstance(item, RemoteFailed):
                ended.append(self.scheduler.fail(req, item.status, item.message))
            elif self._resume(item):
                ended.append(req)
        return ended

    def _resume(self, landed: Landed) -> bool:
        """The remote KV is in req's pages (written between steps). With the prompt's last
        logits row the first token is emitted as a local prefill would (the speculator resumes
        from the prefill worker's state); else the landed tokens count as computed and the
        engine computes the rest. True when the request is complete."""
        req = landed.req
        self.scheduler.resume_remote(req)
        if landed.logits is not None:
            req.computed = len(req.tokens)
            if self.spec is not None:
                self.spec.resume(req, landed.state)  # the draft's layers came in the same pages
            return self._emit(req, landed.logits)
        if landed.tokens is not None:
            req.computed = landed.tokens
            if req.draft_computed is not None:
                req.draft_computed = req.computed  # a page carries its draft part, as a hit does
            self.kv.cache_pages(req, final=False)  # cached the way a computed chunk is
        return False

    # ---- prefix-cache reset -------------------------------------------------------------------
    def preempt_running(self) -> int:
        """Every running request back to the head of the queue (vLLM's recompute preemption)."""
        return self.scheduler.preempt_running()

    def reset_prefix_cache(self, reset_running: bool = False, drop_host: bool = False) -> bool:
        """Forget every cached device page (drop_host: host too; never storage). False,
        changing nothing, while requests run and reset_running is off, or while remote KV is
        in flight (Scheduler.clear_for_reset); else every pending copy lands first, through the
        cache's one drain loop under the step agreement (the same turns on every rank)."""
        if self.cache is None:
            return True
        if not self.scheduler.clear_for_reset(reset_running):
            return False
        self.kv.landed(self.cache.drain(self.agree, RESET_DRAIN_S, "prefix-cache reset"))
        return self.kv.reset_prefix(drop_host)

    # ---- after the forward --------------------------------------------------------------------
    def postprocess(self, work: Work, fwd: Forward) -> list[Request]:
        """Each item's tokens count as computed; verify drafts, emit tokens, cache pages. What
        one item raises (its sampling, its hand-off hook, its lease work) ends it alone."""
        finished = []
        for (req, toks), row, h in zip(work, fwd.rows, fwd.hidden, strict=True):
            try:
                done = self._after_forward(req, toks, row, h, fwd.drafts.get(req.rid))
            except Exception as exc:  # noqa: BLE001 - this request fails, its batch mates go on
                traceback.print_exc(file=sys.stderr)
                why = f"request {req.rid} failed in an engine step: {type(exc).__name__}: {exc}"
                done = self.scheduler.fail(req, 500, why) is req
            if done:
                finished.append(req)
        return finished

    def _after_forward(
        self,
        req: Request,
        toks: list[int],
        row: torch.Tensor,
        h: torch.Tensor | None,
        drafted: list[int] | None,
    ) -> bool:
        """One work item after the forward; True when its request ended."""
        if req.state is State.DECODE and drafted:
            return self._verify(req, drafted, row, h)
        if req.state is State.PREFILL:
            self.prompt_tokens += len(toks)
        req.computed += len(toks)
        if req.state is State.PREFILL and (req.output or req.computed < len(req.tokens)):
            if req.output and req.computed == len(req.prefill_tokens):  # preempted, caught up
                self.scheduler.caught_up(req)
            self.kv.cache_pages(req, final=False)  # finished pages: shared at once
            return False  # more prompt chunks to go
        return self._emit(req, row[-1])

    def _verify(
        self, req: Request, drafted: list[int], rows: torch.Tensor, hidden: torch.Tensor | None
    ) -> bool:
        """Accept drafts by the greedy or the rejection rule (rows: [n+1, vocab]); True if done."""
        assert self.spec is not None and req.draft_computed is not None
        a, emit = self.spec.verify(req, drafted, rows)
        c = req.computed
        if self.decisions is not None:  # under ranks the step consensus compares these
            self.decisions.record("spec", rid=req.rid, drafted=drafted, accepted=a, emit=emit)
        self.spec.record(req, len(drafted), a)
        self.spec.settle(req, c, len(drafted), a, hidden)
        for j, tok in enumerate(emit):
            req.computed = c + j + 1  # KV of the token before emit[j] is final
            if self._emit(req, rows[j], tok):
                return True
        return False

    def _emit(self, req: Request, row: torch.Tensor, tok: int | None = None) -> bool:
        """Record one generated token (`tok`, or chosen from `row` now); True when complete."""
        if tok is None:
            tok = self.runner.sample(req, row)
        if req.sampler is not None and req.sampler.failed:  # no token: an error, not a "stop"
            self.scheduler.fail(req, 500, f"request {req.rid}: {req.sampler.failed}")
            return True
        req.output.append(tok)
        if req.keep_logits:
            req.logits.append(row.clone())
        if req.state is State.PREFILL:
            self.scheduler.first_token(req)
            self.kv.cache_pages(req, final=False)  # share the prompt with later requests
        if self.on_token is not None:
            self.on_token(req, tok)
        stop = req.sampler is not None and req.sampler.stops(tok)
        if len(req.output) < req.max_new_tokens and not stop:
            return False
        self.scheduler.finish(req, "stop" if stop else "length")
        return True

    # ---- integrity ----------------------------------------------------------------------------
    def _check_held(self, req: Request) -> None:
        """A held request (its connector reads its pages): its lease is open, none of its pages
        is free; those it committed are the tree's (locked by its lease), the rest its own."""
        lease = req.lease
        assert lease is not None and lease.state is LeaseState.ADMITTED, (
            f"{req.rid}: held, no lease"
        )
        assert all(not self.pool.allocator.is_free(p) for p in lease.page_table), (
            f"{req.rid}: a held page is free"
        )
        if self.cache is not None:
            own = lease.page_table[lease.inserted :]
            assert set(own) <= self.cache.owned, f"{req.rid}: a held page is the tree's and its own"
            assert lease.inserted == 0 or lease.locked is not None, f"{req.rid}: unlocked"

    def check_integrity(self) -> None:
        """Cache and pool invariants, every running request's pages are allocated, and every
        held request's pages are its own or locked in the tree, never both."""
        if self.cache is not None:
            self.cache.check_integrity()
        self.pool.check_integrity()
        for req in self.scheduler.held.values():
            self._check_held(req)
        for req in self.running:
            assert len(req.page_table) == req.pages_needed(self.page) or req.state is State.DONE
            assert all(not self.pool.allocator.is_free(p) for p in req.page_table), (
                "running on a free page"
            )

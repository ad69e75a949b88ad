"""The reference serving engine: continuous batching with chunked prefill over the tiered cache.

One `step()`: agree on and apply finished cache moves, admit waiting requests, run one forward
over decodes (one token each) and prefill chunks, sample greedily, cache finished pages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvstrata.cache.keys import as_token_array
from kvstrata.cache.manager import HiCache
from kvstrata.engine import reset
from kvstrata.engine.admission import Admission
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request, State
from kvstrata.engine.speculative import Speculator
from kvstrata.memory.pool import DevicePool
from kvstrata.model.decoder import DecoderLM, SeqBatch

Agree = Callable[[list[int]], list[int]]
"""Turns this rank's cache progress vector into the agreed one (identity on one rank)."""


class DecisionSink(Protocol):
    """Where a rank logs its cache decisions per step (kvstrata.parallel.decision_log.DecisionLog)."""

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
        admission: Admission,
        config: EngineConfig,
        agree: Agree | None = None,
        clock: Callable[[], float] = time.monotonic,
        decisions: DecisionSink | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.model, self.pool, self.cache, self.config = model, pool, cache, config
        self.spec = speculator  # None: plain decoding
        self.admission = admission
        self.agree = agree or (lambda v: v)
        # decisions (prefetch budgets) read `clock`: under several ranks an agreed clock (rank 0's
        # time, broadcast); TTFT and other metrics read this rank's wall time
        self.clock = clock
        self.decisions = decisions
        self.page = pool.shape.page_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.steps = 0
        self.prompt_tokens = 0  # prompt tokens this engine's forwards computed (not hits/pulls)
        self.on_token: Callable[[Request, int], None] | None = None
        """Called with each token as it is produced (the server streams from it)."""
        self.step_hook: Callable[[Engine], list[Request]] | None = None
        """Called once per step after admission (P/D: starts and lands remote prefills); returns
        the requests it finished."""
        self.layer_hook: Callable[[list[Request], int], None] | None = None
        """Called after each target layer of a forward with the requests whose prompt it
        completes (P/D prefill sends that layer's pages at once); not while speculating."""

    # ---- API ----------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
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
        req.arrival_s = time.monotonic()  # metrics use this rank's wall time
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self, requests: list[Request]) -> list[Request]:
        """Submit and run to completion; returns the requests in finishing order."""
        for req in requests:
            self.submit(req)
        done: list[Request] = []
        while self.has_work():
            done += self.step()
        return done

    def step(self) -> list[Request]:
        """One scheduler step; returns the requests that finished in it."""
        self.steps += 1
        log = self.decisions
        if log is not None:
            log.begin_step(self.steps)
        if self.cache is not None:
            agreed = self.agree(self.cache.local_progress())
            if log is not None and log.should_skip(self.steps):
                agreed = _hold_back_one(agreed)  # injected divergence: this rank skips a decision
            applied = self.cache.apply(agreed)
            if log is not None and applied:
                log.record(
                    "apply", ops=[x for op in applied for x in (op.kind, op.agreed, op.pages)]
                )
        slots = self.config.max_running - len(self.running)
        admitted = self.admission.advance(self.waiting, self.clock(), slots)
        for req in admitted:
            self.waiting.remove(req)
            self.running.append(req)
            if self.spec is not None:
                req.draft_computed = req.computed  # hit pages bring their draft part along
            if log is not None:
                log.record(
                    "admit",
                    rid=req.rid,
                    pages=req.page_table,
                    hits=[req.hits["L1"], req.hits["L2"], req.hits["L3"]],
                )
        finished = self.step_hook(self) if self.step_hook is not None else []
        work = self._plan()
        finished += self._forward(work) if work else []
        if log is not None:
            for req in finished:
                log.record("finish", rid=req.rid, cached_pages=len(req.page_table))
            log.end_step(self.steps)
        if not work:
            time.sleep(0.0005)  # only waiting on copies or storage: don't spin hot
        return finished

    def abort(self, rid: str) -> Request | None:
        """End a waiting or running request now, releasing its pages and locks at once (a
        running one's computed full pages stay cached, like a finished request's); None when no
        such request is in flight."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.admission.abort(req)
                return _ended(req, "abort")
        for req in self.running:
            if req.rid == rid:
                self.admission.cache_pages(req, final=True)
                self.running.remove(req)
                return _ended(req, "abort")
        return None

    def spec_stats(self) -> dict[str, float] | None:
        """Speculative decoding figures over every request so far (None when it is off)."""
        return self.spec.stats.as_dict() if self.spec is not None else None

    def drain(self) -> None:
        if self.cache is not None:
            self.cache.drain()

    # ---- remote prefill (P/D decode: another worker computes the prompt) --------------------
    def finish_remote_prefill(
        self, req: Request, row: torch.Tensor, state: torch.Tensor | None = None
    ) -> bool:
        """The prompt's KV is in req's pages now (written between steps); `row` [vocab] is the
        prompt's last logits: emit the first token as a local prefill would. `state`: the prefill
        worker's Speculator.handoff_state (speculating). True when done."""
        assert req.remote and req.state is State.PREFILL, f"{req.rid} is not a remote prefill"
        req.computed = len(req.tokens)
        if self.spec is not None:
            self.spec.resume(req, state)  # the draft's layers came in the same pages
        return self._emit(req, row)

    def fail_remote(self, req: Request, status: int, message: str) -> Request:
        """End a remote prefill that failed: its pages and locks go back, the client gets
        `status` and `message` (the loop reads req.failure)."""
        self.admission.cache_pages(req, final=True)  # only the held prefix is cached
        self.running.remove(req)
        req.failure = (status, message)
        return _ended(req, "error")

    # ---- prefix-cache reset (kvstrata/engine/reset.py) ---------------------------------------
    def preempt_running(self) -> int:
        """Every running request back to the head of the queue (vLLM's recompute preemption)."""
        return reset.preempt_running(self)

    def reset_prefix_cache(self, reset_running: bool = False, drop_host: bool = False) -> bool:
        """Forget every cached L1 page (drop_host: L2 too; never L3); False while requests run
        and reset_running is off (see reset.reset_prefix_cache)."""
        return reset.reset_prefix_cache(self, reset_running, drop_host)

    # ---- one forward --------------------------------------------------------------------------
    def _plan(self) -> list[tuple[Request, list[int]]]:
        """Tokens each running request feeds this step: decodes first, then prefill chunks."""
        budget = self.config.max_batch_tokens
        work: list[tuple[Request, list[int]]] = []
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
        return work

    def _forward(self, work: list[tuple[Request, list[int]]]) -> list[Request]:
        loads = [r.lease.load.handle for r, _ in work if _pending_load(r)]

        def wait_layer(layer: int) -> None:
            for handle in loads:  # layer l's pages arrived from L2 before layer l reads them
                handle.wait_layer(layer)

        wait = wait_layer if loads else None
        drafts = self.spec.propose(work, self.pool, wait) if self.spec is not None else {}
        hidden: list[torch.Tensor] | None = [] if self.spec and self.spec.wants_hidden else None
        rows = self._logits(work, drafts, wait, hidden)
        hid = hidden or [None] * len(work)  # per item [its tokens, hidden] (MTP only)
        if self.spec is not None:
            items = zip(work, hid, strict=True)
            prefills = [(r, h) for (r, _), h in items if r.state is State.PREFILL]
            self.spec.after_forward(prefills, self.pool, wait)  # type: ignore[arg-type]
        finished = []
        for (req, toks), row, h in zip(work, rows, hid, strict=True):
            assert req.lease is not None
            req.lease.load = None  # waited for, layer by layer, in this forward
            if req.state is State.DECODE and drafts.get(req.rid):
                if self._verify(req, drafts[req.rid], row, h):
                    finished.append(req)
                continue
            if req.state is State.PREFILL:
                self.prompt_tokens += len(toks)
            req.computed += len(toks)
            if req.state is State.PREFILL and (req.output or req.computed < len(req.tokens)):
                if req.output and req.computed == len(req.prefill_tokens):  # preempted, caught up
                    req.state = State.DECODE  # its next step feeds its last token, as before
                self.admission.cache_pages(req, final=False)  # finished pages: shared at once
                continue  # more prompt chunks to go
            if self._emit(req, row[-1]):
                finished.append(req)
        return finished

    def _logits(
        self,
        work: list[tuple[Request, list[int]]],
        drafts: dict[str, list[int]],
        wait: Callable[[int], None] | None,
        hidden: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Target logits per work item: [1, vocab] (its last token), or [n+1, vocab] for a
        decode verifying n drafts. Verifies run in a forward of their own (all rows kept).
        `hidden` (if given) gets each item's last-layer states [its tokens, hidden]."""
        plain = [i for i, (r, _) in enumerate(work) if not drafts.get(r.rid)]
        out: list[torch.Tensor] = [torch.empty(0)] * len(work)
        hid: list[torch.Tensor] = [torch.empty(0)] * len(work)
        for idx, last_only in (
            (plain, True),
            ([i for i in range(len(work)) if i not in plain], False),
        ):
            if not idx:
                continue
            items = [work[i] for i in idx]
            toks = [t + drafts.get(r.rid, []) for r, t in items]
            batch = SeqBatch.build(
                toks, [r.computed for r, _ in items], [r.page_table for r, _ in items]
            )
            before, last = self._layers_done(items, wait)
            states: list[torch.Tensor] = []
            # hidden_out only when asked (an MTP head): the TP / PP / CP forwards all take it
            extra = {"hidden_out": states} if hidden is not None else {}
            logits = self.model(batch, self.pool, before_layer=before, last_only=last_only, **extra)
            if last is not None:
                last()
            parts = logits.split(1) if last_only else logits.split(batch.seq_lens)
            for i, part in zip(idx, parts, strict=True):
                out[i] = part
            if hidden is not None:
                for i, h in zip(idx, states[0].split(batch.seq_lens), strict=True):
                    hid[i] = h
            wait = None  # every pending load was waited for, layer by layer
        if hidden is not None:
            hidden.extend(hid)
        return out

    def _layers_done(
        self, items: list[tuple[Request, list[int]]], wait: Callable[[int], None] | None
    ) -> tuple[Callable[[int], None] | None, Callable[[], None] | None]:
        """`before_layer` that also reports each finished layer to layer_hook (layer i - 1 is
        written when layer i starts), and the report of the last layer after the forward."""
        hook = self.layer_hook
        done = [
            r for r, t in items if r.state is State.PREFILL and r.computed + len(t) == len(r.tokens)
        ]
        if hook is None or not done or self.spec is not None:
            return wait, None

        def before(i: int) -> None:
            if wait is not None:
                wait(i)
            if i:
                hook(done, i - 1)

        last = self.pool.shape.num_layers - 1  # this rank's layers (a pp stage has a part)
        return before, lambda: hook(done, last)

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
            tok = int(torch.argmax(row)) if req.sampler is None else req.sampler.sample(row)
        req.output.append(tok)
        if req.keep_logits:
            req.logits.append(row.clone())
        if req.state is State.PREFILL:
            req.first_token_s = time.monotonic()
            req.state = State.DECODE
            self.admission.cache_pages(req, final=False)  # share the prompt with later requests
        if self.on_token is not None:
            self.on_token(req, tok)
        stop = req.sampler is not None and req.sampler.stops(tok)
        if len(req.output) < req.max_new_tokens and not stop:
            return False
        self.admission.cache_pages(req, final=True)
        self.running.remove(req)
        _ended(req, "stop" if stop else "length")
        return True

    # ---- integrity ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Cache and pool invariants, and every running request's pages are allocated."""
        if self.cache is not None:
            self.cache.check_integrity()
        self.pool.check_integrity()
        for req in self.running:
            assert len(req.page_table) == req.pages_needed(self.page) or req.state is State.DONE
            assert all(not self.pool.allocator.is_free(p) for p in req.page_table), (
                "running on a free page"
            )


def _pending_load(req: Request) -> bool:
    """The request's L2 -> L1 copy has not been waited for yet."""
    lease = req.lease
    return lease is not None and lease.load is not None and lease.load.handle is not None


def _ended(req: Request, reason: str) -> Request:
    req.state = State.DONE
    req.finish_s = time.monotonic()
    req.finish_reason = reason
    return req

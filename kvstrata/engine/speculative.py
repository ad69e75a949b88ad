"""Speculative decoding: a draft proposes N tokens, the target verifies them in one forward.

Per decoding request with `computed = c` (KV final for positions < c) and last token t_c:
- draft: catch up on the tokens it has no KV for, all_tokens[draft_computed : c + 1] (one token,
  or two after a step that accepted every draft), then feed its own proposals d_1 .. d_{n-1}
  one at a time; its KV goes to the draft's tail layers of the request's own pages;
- target: one forward over [t_c, d_1 .. d_n] at positions c .. c+n gives rows 0 .. n; a greedy
  request takes their argmax g_0 .. g_n, a = the longest prefix with d_j == g_{j-1}, and emits
  g_0 .. g_a (a sampled one: the rejection rule below).

Afterwards `computed = c + a + 1` (only accepted tokens count) and `draft_computed = c +
min(n, a + 1)`. KV written at rejected positions sits in the request's own, never committed,
pages: a page joins the tree only once it holds `min(computed, draft_computed)` final tokens
(Request.final_kv_tokens), and rejected positions are simply written over later.

With sampling (temperature > 0) the draft draws d_j from q_j = its row cut like the target's
(temperature, top_p), and verification is the standard rejection rule (accept_sampled): every
draw comes from the request's own generator in a fixed order, so every rank draws alike.

n = min(spec_tokens, tokens still to produce - 1), so every position written lies inside the
pages the request was admitted with. Prefill chunks run through the draft too (same tokens,
same positions), so a cached page always carries both parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstrata.engine.request import Request, State
from kvstrata.engine.sampling import Sampler
from kvstrata.model import step_ops
from kvstrata.model.decoder import DecoderLM, SeqBatch
from kvstrata.model.draft import DraftKV

Work = list[tuple[Request, list[int]]]
Wait = Callable[[int], None] | None  # wait(pool layer) for pending host -> device loads
Proposals = dict[str, list[int]]  # rid -> drafted tokens d_1 .. d_n


@dataclass
class SpecStats:
    """Verify steps, drafted and accepted tokens, summed over every request of an engine.

    Plain numbers only (the server's /metrics reads them from another thread at scrape time);
    `accepted_per_pos[j]` counts verify steps that accepted draft j (0-based), sized N once."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    """Wall seconds in the draft's passes (proposals and prefill catch-up; a bench's breakdown)."""

    def as_dict(self) -> dict[str, float]:
        """acceptance_rate = accepted / proposed; accept_length = tokens emitted per verify step
        (accepted drafts + the target's own token), as SGLang reports its accept length."""
        return {
            "verify_steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "accept_length": (self.accepted + self.steps) / self.steps if self.steps else 0.0,
        }


class Speculator:
    """The draft model, its place in the pool (tail layers) and N."""

    def __init__(self, draft: DecoderLM, layer_offset: int, spec_tokens: int) -> None:
        self.draft, self.offset, self.n = draft, layer_offset, spec_tokens
        # kept apart from self.draft, which a parallel rank swaps for a wrapper of it
        # (kvstrata.ranks.spec.place_speculator) that has no fingerprint of its own
        self.draft_fingerprint: str = draft.fingerprint
        self.stats = SpecStats(accepted_per_pos=[0] * spec_tokens)
        self.draft_probs: dict[str, list[torch.Tensor]] = {}
        """This step's q_j [vocab] per sampling request (rid -> one per draft), for verify."""

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        """One verify step of `req`: on the request and in the engine-wide stats."""
        req.spec_proposed += proposed
        req.spec_accepts.append(accepted)
        self.stats.steps += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        for j in range(accepted):  # a accepted drafts: positions 0 .. a-1 each accepted once
            self.stats.accepted_per_pos[j] += 1

    def budget(self, req: Request) -> int:
        """Drafts to propose for `req` this step (0 for its last token)."""
        return max(0, min(self.n, req.max_new_tokens - len(req.output) - 1))

    def propose(self, work: Work, pool: object, wait: Callable[[int], None] | None) -> Proposals:
        """Run the draft over this step's prefill chunks and decodes; the decodes' proposals.

        `wait(layer)` blocks until pool layer `layer` of pending host -> device loads has arrived.
        """
        seqs: list[tuple[Request, list[int], int]] = []
        for req, toks in work:
            if req.state is State.PREFILL:
                assert req.draft_computed == req.computed, "draft out of step in prefill"
                seqs.append((req, toks, req.computed))
            elif self.budget(req):
                start = req.draft_computed
                assert start is not None and start <= req.computed
                seqs.append((req, req.all_tokens[start : req.computed + 1], start))
        self.draft_probs = {}
        if not seqs:
            return {}
        kv = DraftKV(pool, self.offset)
        before = None if wait is None else (lambda i: wait(self.offset + i))
        reqs = [r for r, _, _ in seqs]
        logits = self._run([t for _, t, _ in seqs], [s for _, _, s in seqs], reqs, kv, before)
        out: Proposals = {}
        for (req, toks, _), row in zip(seqs, logits, strict=True):
            if req.state is State.PREFILL:
                req.draft_computed += len(toks)
            else:
                out[req.rid] = [self._pick(req, row)]
        self._extend(out, [r for r in reqs if r.rid in out], kv)
        return out

    def _pick(self, req: Request, row: torch.Tensor) -> int:
        """The draft's token from its row [vocab]: argmax, or a draw from q (kept for verify)."""
        if req.sampler is None or req.sampler.greedy:
            return step_ops.argmax(row)
        q = req.sampler.probs(row)
        self.draft_probs.setdefault(req.rid, []).append(q)
        return req.sampler.draw(q)

    wants_hidden = False
    """The draft needs the target's hidden states (an MTP head); a draft model does not."""

    @property
    def fingerprint(self) -> str:
        """The draft's part of the namespace fingerprint (and of a P/D worker's layout)."""
        return f"draft:{self.draft_fingerprint}"

    def handoff_state(self, req: Request) -> torch.Tensor | None:
        """What a P/D decode worker needs besides the pages to speculate on `req` once its prompt
        is computed here: nothing for a draft model (its KV is in the pages' tail layers)."""
        return None

    def resume(self, req: Request, state: torch.Tensor | None) -> None:
        """`req`'s prompt KV, the draft's tail layers included, was written by another worker
        (P/D); `state` is that worker's handoff_state."""
        req.draft_computed = req.computed

    def after_forward(
        self, prefills: list[tuple[Request, torch.Tensor]], pool: object, wait: Wait
    ) -> None:
        """After the target's forward, before `computed` moves: prefill chunks (with their
        hidden states [m, hidden] when wants_hidden). A draft model ran over them already."""

    def settle(self, req: Request, c: int, n: int, a: int, hidden: torch.Tensor | None) -> None:
        """After verifying n drafts at c with a accepted (hidden: the verify's [n+1, hidden])."""
        req.draft_computed = c + min(n, a + 1)  # draft KV valid up to c + a

    def verify(self, req: Request, drafted: list[int], rows: torch.Tensor) -> tuple[int, list[int]]:
        """(a, tokens to emit) for `req`'s drafts against the target's rows [n+1, vocab]."""
        if req.sampler is None or req.sampler.greedy:
            return accept(drafted, rows)
        return accept_sampled(drafted, self.draft_probs[req.rid], rows, req.sampler)

    def _extend(self, out: Proposals, reqs: list[Request], kv: DraftKV) -> None:
        """Feed each request's latest proposal until it has its budget of drafts."""
        step = 1
        while True:
            active = [r for r in reqs if len(out[r.rid]) < self.budget(r)]
            if not active:
                return
            toks = [[out[r.rid][-1]] for r in active]
            starts = [r.computed + step for r in active]  # d_step sits at position c + step
            for r, row in zip(active, self._run(toks, starts, active, kv, None), strict=True):
                out[r.rid].append(self._pick(r, row))
            step += 1

    def _run(
        self,
        toks: Sequence[Sequence[int]],
        starts: Sequence[int],
        reqs: Sequence[Request],
        kv: DraftKV,
        before: Callable[[int], None] | None,
    ) -> torch.Tensor:
        batch = SeqBatch.build(toks, starts, [r.page_table for r in reqs])
        return self.draft(batch, kv, before_layer=before, last_only=True)  # [seqs, vocab]


def accept(drafted: list[int], rows: torch.Tensor) -> tuple[int, list[int]]:
    """(a, g_0 .. g_a): accepted drafts and the tokens to emit, from the target's rows [n+1, V]."""
    greedy = [step_ops.argmax(row) for row in rows]  # native: ~10x torch's on a vocab row
    a = 0
    while a < len(drafted) and drafted[a] == greedy[a]:
        a += 1
    return a, greedy[: a + 1]


def accept_sampled(
    drafted: list[int], q: list[torch.Tensor], rows: torch.Tensor, sampler: Sampler
) -> tuple[int, list[int]]:
    """The rejection rule: draft d_j ~ q_j is kept with probability min(1, p_j(d_j) / q_j(d_j));
    the first rejected one is replaced by a draw from norm(max(0, p_j - q_j)); when all n are
    kept, a bonus token comes from p_n. p_j = the target's row j cut like q (temperature, top_p).
    The emitted tokens are distributed exactly as plain sampling from the target's rows would be.
    Draws, in order: one coin per examined draft, then one token."""
    for j, d in enumerate(drafted):
        p = sampler.probs(rows[j])  # [vocab]
        if sampler.uniform() * float(q[j][d]) < float(p[d]):  # u < p/q without dividing by 0
            continue
        residual = torch.clamp(p - q[j], min=0.0)
        # a rejection implies p(d) < q(d), so some mass of p lies above q: residual sums > 0
        # (fp rounding aside; then p itself, which the residual is then indistinguishable from)
        return j, [*drafted[:j], sampler.draw(residual if float(residual.sum()) > 0 else p)]
    return len(drafted), [*drafted, sampler.draw(sampler.probs(rows[len(drafted)]))]

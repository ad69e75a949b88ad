"""Speculative decoding with an MTP head (kvstrata.model.mtp): the head's entry j needs the
target's hidden state at j - 1, so it runs after the target where a draft model runs before.

Per decoding request with `computed = c`, `draft_computed = dc` and the target's states
h_{dc-1} .. h_{c-1} (Request.draft_hidden):
- propose: entries dc .. c with the true states (final: draft KV valid up to c + 1), then
  chained drafts: entry c + s takes the head's own output g_{c+s-1} in place of the unknown
  h_{c+s-1} and embeds d_s; d_{s+1} = its prediction;
- settle after verifying with a accepted: draft_computed = c + 1 (entries past c used g, not h)
  and draft_hidden = the verify's h_c .. h_{c+a}, the inputs of entries c + 1 .. c + a + 1;
- prefill chunks: after the target's forward, entries s .. s+m-1 from h_{s-1} (kept from the
  previous chunk) and the chunk's own states; draft_computed moves with computed.
Every entry takes the target's real h_{j-1}, at a page's first position too: each page keeps
the target's state at its last position in layers of its own (kvstrata.model.page_state),
written once that position's KV is final (a prefill chunk, a verify's accepted rows), and an
entry right after a prefix hit (or a P/D handoff at a page boundary) reads it from the
previous page. Restored pages then feed the draft exactly what a cold run computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstrata.engine.request import Request, State
from kvstrata.engine.speculative import Proposals, Speculator, Wait, Work
from kvstrata.model.decoder import SeqBatch
from kvstrata.model.draft import DraftKV
from kvstrata.model.mtp import MTPHead
from kvstrata.model.page_state import PageStates


class MTPSpeculator(Speculator):
    """The MTP head, its one tail layer of the pool, the page-state layers after it, N and
    the page size."""

    wants_hidden = True

    def __init__(
        self, head: MTPHead, layer_offset: int, spec_tokens: int, page: int, state_layers: int
    ) -> None:
        super().__init__(head, layer_offset, spec_tokens)  # type: ignore[arg-type]
        # self.draft runs the head: the head itself, or a parallel rank's wrapper of it
        self.page, self.hidden_size = page, head.eh_proj.out_features
        self.states = PageStates(layer_offset + 1, state_layers, self.hidden_size)
        self._pool: object = None  # this step's pool (settle writes page states into it)

    def place(self, layer_offset: int) -> None:
        """A parallel rank's pool view: the head's layer at `layer_offset`, states after it."""
        self.offset = layer_offset
        self.states.first = layer_offset + 1

    def _before(self, req: Request, first: int, wait: Wait) -> torch.Tensor:
        """h_{first-1} [1, hidden] where the request kept none: first is a page start (a hit's
        or handoff's boundary); the previous page's state, zeros before position 0."""
        assert first % self.page == 0, f"{req.rid}: MTP entry {first} has no hidden state"
        if first == 0:
            return torch.zeros(1, self.hidden_size)
        return self.states.read(self._pool, req.page_table[first // self.page - 1], wait)

    def _keep(self, req: Request, first: int, hidden: torch.Tensor) -> None:
        """Final target states `hidden` [n, hidden] at positions first ..: those at a page's
        last position become that page's state."""
        for p in range(first, first + hidden.shape[0]):
            if p % self.page == self.page - 1:
                self.states.write(self._pool, req.page_table[p // self.page], hidden[p - first])

    def _head(
        self,
        reqs: list[Request],
        toks: list[list[int]],
        starts: list[int],
        hs: list,
        kv: DraftKV,
        before: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last rows' logits [seqs, vocab], head outputs of each sequence's last entry)."""
        batch = SeqBatch.build(toks, starts, [r.page_table for r in reqs])
        logits, g = self.draft(batch, torch.cat(hs), kv, last_only=True, before_layer=before)
        return logits, g[torch.tensor(batch.seq_lens).cumsum(0) - 1]

    def propose(self, work: Work, pool: object, wait: Wait) -> Proposals:
        """Drafts of this step's decodes (prefill chunks run in after_forward)."""
        self.draft_probs = {}
        reqs = [r for r, _ in work if r.state is State.DECODE and self.budget(r)]
        self._pool = pool
        if not reqs:
            return {}
        kv = DraftKV(pool, self.offset)
        toks, starts, hs = [], [], []
        for r in reqs:
            dc, c = r.draft_computed, r.computed
            assert dc is not None and dc <= c
            toks.append(r.all_tokens[dc : c + 1])
            starts.append(dc)
            h = r.draft_hidden if r.draft_hidden is not None else self._before(r, dc, wait)
            assert h.shape[0] == c + 1 - dc, (h.shape, dc, c)
            hs.append(h)
        logits, g = self._head(reqs, toks, starts, hs, kv)
        out = {r.rid: [self._pick(r, row)] for r, row in zip(reqs, logits, strict=True)}
        last = dict(zip((r.rid for r in reqs), g, strict=True))
        step = 1
        while active := [r for r in reqs if len(out[r.rid]) < self.budget(r)]:
            pos = [r.computed + step for r in active]  # entry c + step embeds d_step
            hs = [last[r.rid][None] for r in active]  # the head's own g in place of h
            logits, g = self._head(active, [[out[r.rid][-1]] for r in active], pos, hs, kv)
            for r, row, g_r in zip(active, logits, g, strict=True):
                out[r.rid].append(self._pick(r, row))
                last[r.rid] = g_r
            step += 1
        return out

    def after_forward(
        self, prefills: list[tuple[Request, torch.Tensor]], pool: object, wait: Wait
    ) -> None:
        self._pool = pool
        if not prefills:
            return
        reqs = [r for r, _ in prefills]
        toks = [r.tokens[r.computed : r.computed + h.shape[0]] for r, h in prefills]
        hs = []
        for r, h in prefills:
            assert r.draft_computed == r.computed, "MTP head out of step in prefill"
            prev = r.draft_hidden
            if prev is None:  # the prompt's start, or a hit's last page boundary
                prev = self._before(r, r.computed, wait)
            hs.append(torch.cat([prev.to(h.dtype), h[:-1]]))
            self._keep(r, r.computed, h)
        # pending host -> device loads carry the head's layer too: wait for it before it is read
        before = None if wait is None else (lambda i: wait(self.offset + i))
        kv = DraftKV(pool, self.offset)
        self._head(reqs, toks, [r.computed for r in reqs], hs, kv, before)
        for r, h in prefills:
            r.draft_computed = r.computed + h.shape[0]
            r.draft_hidden = h[-1:]  # h_{s+m-1}: the input of the next entry

    @property
    def fingerprint(self) -> str:
        # "+state": pages carry the target state (older pages without it never match)
        return f"mtp+state:{self.draft_fingerprint}"

    def handoff_state(self, req: Request) -> torch.Tensor | None:
        """h_{L-1} [1, hidden] after the prompt's L tokens: the input of the first decode entry,
        which only the worker that ran the target's prefill has."""
        return req.draft_hidden

    def resume(self, req: Request, state: torch.Tensor | None) -> None:
        super().resume(req, state)
        if state is None and req.computed % self.page:
            raise ValueError(f"{req.rid}: MTP entry {req.computed} needs prefill's hidden state")
        req.draft_hidden = state

    def settle(self, req: Request, c: int, n: int, a: int, hidden: torch.Tensor | None) -> None:
        assert hidden is not None and hidden.shape[0] == n + 1
        self._keep(req, c, hidden[: a + 1])  # KV at c .. c + a is final
        req.draft_computed = c + 1
        req.draft_hidden = hidden[: a + 1]

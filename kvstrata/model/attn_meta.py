"""Per-forward attention metadata: where each new token's K/V goes in the paged pool, and what
each sequence reads back (built once per forward, shared by every layer; attention.py uses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.model.page_runs import page_runs, write_plan
from kvstrata.model.paged_decode import flat_tables

ROWS_AS_DECODE = 8
"""Most new tokens per sequence read as queries by the batched decode kernel (a sequence's rows
read its pages in place, once for all of them; a gather and a masked kernel per sequence cost
more at this size: a speculative verify's rows); prefill chunks take the per-sequence kernels."""


@dataclass(frozen=True)
class DecodeRows:
    """A rows_as_decode forward's rows as paged_decode takes them: R rows per sequence sharing
    one read of its pages, row r seeing positions 0 .. ctx - R + r (the verify's causal rule).
    A sequence adding n < R tokens runs R rows, its first row repeated R - n times in front,
    so that its real row i is kernel row R - n + i and sees positions 0 .. ctx - n + i (int64,
    host tensors)."""

    flat: torch.Tensor
    """[P] every sequence's page table in turn (flat_tables)."""
    starts: torch.Tensor
    """[S] each sequence's first entry in `flat`."""
    ctx: torch.Tensor
    """[S] each sequence's context after this forward (its last row's)."""
    rows: int
    """R: the most new tokens of any sequence (1: a plain decode step)."""
    pad: torch.Tensor | None
    """[S * R] the forward's row each kernel row reads; None where every sequence has R."""
    keep: torch.Tensor | None
    """[T] the kernel row of each of the forward's rows; None where every sequence has R."""


@dataclass
class AttnMeta:
    """Per-forward index tensors shared by every layer (computed once per forward)."""

    slots: torch.Tensor  # [T] flat slot page_id * page_size + offset of each new token
    seq_lens: list[int]  # new tokens per sequence
    ctx_lens: list[int]  # context length of each sequence after this forward
    page_tables: list[torch.Tensor]  # per sequence [>= ceil(ctx / page)] long device page ids
    page_size: int
    tail: list[bool]  # per sequence: its new tokens sit at positions ctx-n .. ctx-1, in order
    positions: torch.Tensor  # [T] absolute positions
    # per sequence: its context's pages as runs [(first page id, pages)] of consecutive ids,
    # each read in place as one slice of the pool; None = too fragmented, gathered (page_runs)
    runs: list[list[tuple[int, int]] | None] = field(default_factory=list)
    # new rows written as slices (first flat slot, first row, rows) of the pool (write_plan);
    # none: every row by one index_copy_; else the rows no span holds [R] go to rest_slots [R]
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    rest_rows: torch.Tensor | None = None
    rest_slots: torch.Tensor | None = None
    _slots: list[torch.Tensor] = field(default_factory=list, repr=False)
    _decode: DecodeRows | None = field(default=None, repr=False)
    _apart: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _masks: list[torch.Tensor] = field(default_factory=list, repr=False)
    _slot_range: tuple[int, int] | None = field(default=None, repr=False)

    def last_rows(self, rows: torch.Tensor) -> AttnMeta:
        """The queries of `rows` [num_seqs] alone, each its sequence's last token (every
        sequence `tail`): one new token per sequence against its whole context, which the
        forward has already written to the pool."""
        assert all(self.tail) and rows.numel() == len(self.seq_lens), "one last row per sequence"
        ones = [1] * len(self.seq_lens)
        return AttnMeta(
            self.slots[rows], ones, self.ctx_lens, self.page_tables, self.page_size,
            [True] * len(ones), self.positions[rows], self.runs,
        )  # fmt: skip

    @property
    def rows_as_decode(self) -> bool:
        """True when every sequence adds at most ROWS_AS_DECODE tokens at its end (a decode
        step, a speculative verify's rows): each row is then a query over the positions up to
        its own, a sequence's rows sharing one read of its pages, all in one batched decode
        call (decode_rows)."""
        return all(self.tail) and max(self.seq_lens) <= ROWS_AS_DECODE

    @property
    def decode_rows(self) -> DecodeRows:
        """What paged_decode reads for this forward's rows (see DecodeRows), every sequence
        as R = its most new tokens rows. Built on first use, shared by every layer."""
        if self._decode is None:
            flat, starts = flat_tables(self.page_tables)
            lens = torch.tensor(self.seq_lens, dtype=torch.long)  # [S]
            rows = int(lens.max()) if lens.numel() else 1
            ctx = torch.tensor(self.ctx_lens, dtype=torch.long)
            pad = keep = None
            if bool((lens != rows).any()):  # a shorter sequence: its first row repeated in front
                first = lens.cumsum(0) - lens  # [S] each sequence's first row
                lead = (rows - lens)[:, None]  # [S, 1] padded rows in front
                pad = (first[:, None] + (torch.arange(rows)[None, :] - lead).clamp(min=0)).view(-1)
                rank = torch.arange(int(lens.sum())) - first.repeat_interleave(lens)  # [T]
                keep = (torch.arange(len(lens)) * rows + rows - lens).repeat_interleave(lens) + rank
            self._decode = DecodeRows(flat, starts, ctx, rows, pad, keep)
        return self._decode

    @property
    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat page tables [P], each row's sequence start in them [T] and each row's context
        [T] (int64, host) for paged_decode with every row its own one-row sequence (where
        shares_rows says no): row i of a sequence adding n tokens to a context of ctx sees
        positions 0 .. ctx - n + i. Built on first use, shared by every layer."""
        if self._apart is None:
            flat, starts = flat_tables(self.page_tables)
            lens = torch.tensor(self.seq_lens, dtype=torch.long)
            first = (lens.cumsum(0) - lens).repeat_interleave(lens)  # [T] each row's seq start
            rank = torch.arange(int(lens.sum())) - first  # [T] i: the row's index in its seq
            ends = torch.tensor(self.ctx_lens, dtype=torch.long) - lens
            ctx = ends.repeat_interleave(lens) + rank + 1
            self._apart = (flat, starts.repeat_interleave(lens), ctx)
        return self._apart

    def slots_within(self, n: int) -> bool:
        """True when every slot lies in [0, n): a native write at `slots` stays inside a pool
        of n slots (the range is read once per forward, shared by every layer)."""
        if self._slot_range is None:
            empty = self.slots.numel() == 0
            lo, hi = (0, -1) if empty else (int(self.slots.min()), int(self.slots.max()))
            self._slot_range = (lo, hi)
        return self._slot_range[0] >= 0 and self._slot_range[1] < n

    @property
    def ctx_slots(self) -> list[torch.Tensor]:
        """Per sequence [ctx] flat slots of its whole context, in order (built on first use)."""
        if not self._slots:
            for ctx, table in zip(self.ctx_lens, self.page_tables, strict=True):
                every = torch.arange(ctx, device=table.device)  # [ctx]
                page = table[every // self.page_size]
                self._slots.append(page * self.page_size + every % self.page_size)
        return self._slots

    @property
    def masks(self) -> list[torch.Tensor]:
        """Per sequence [new, ctx] bool, True = may attend (built on first use)."""
        if not self._masks:
            start = 0
            for n, ctx in zip(self.seq_lens, self.ctx_lens, strict=True):
                pos = self.positions[start : start + n]  # [n]
                start += n
                every = torch.arange(ctx, device=pos.device)  # [ctx]
                # Query at absolute position p sees keys 0..p (positions need not be the last n:
                # context-parallel ranks compute the tokens of the pages they own).
                self._masks.append(every[None, :] <= pos[:, None])
        return self._masks


def build_meta(
    positions: torch.Tensor,
    seq_lens: list[int],
    ctx_lens: list[int],
    page_tables: list[torch.Tensor],
    page_size: int,
) -> AttnMeta:
    """Index tensors for one forward; `positions` [T] are absolute token positions."""
    device = positions.device
    tables = [t.to(device=device, dtype=torch.long) for t in page_tables]
    lens = torch.tensor(seq_lens, device=device)
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)  # [T]
    table_of = torch.cat(tables)  # flat page tables; offset of each sequence's table below
    first = torch.tensor([0, *[t.numel() for t in tables[:-1]]], device=device).cumsum(0)
    page = table_of[first[seq_of] + positions // page_size]  # [T] device page of each token
    slots = page * page_size + positions % page_size
    # tail: positions == ctx - n + arange(n) for every token of the sequence (one host sync)
    ends = torch.tensor(ctx_lens, device=device)[seq_of]  # [T]
    rank = torch.arange(positions.numel(), device=device) - (lens.cumsum(0) - lens)[seq_of]
    expected = ends - lens[seq_of] + rank
    wrong = torch.zeros(len(seq_lens), dtype=torch.long, device=device)
    wrong.index_add_(0, seq_of, (positions != expected).long())
    tail = (wrong == 0).tolist()
    runs = page_runs(page_tables, ctx_lens, page_size)
    plan = write_plan(page_tables, seq_lens, ctx_lens, tail, page_size)
    rest = None if plan.rest is None else plan.rest.to(device)
    return AttnMeta(
        slots,
        list(seq_lens),
        list(ctx_lens),
        tables,
        page_size,
        tail,
        positions,
        runs,
        spans=plan.spans,
        rest_rows=rest,
        rest_slots=None if rest is None else slots[rest],
    )


def write_rows(flat: torch.Tensor, new: torch.Tensor, meta: AttnMeta) -> None:
    """Write a forward's new K or V rows `new` [T, kv_heads, dim] (any strides, any dtype)
    into the flat pool [capacity * page, kv_heads, dim] at meta.slots: one slice copy per span
    of consecutive slots, one index_copy_ for the rows outside them (see write_plan)."""
    if not meta.spans:
        flat.index_copy_(0, meta.slots, new.to(flat.dtype))
        return
    for dst, src, n in meta.spans:
        flat[dst : dst + n].copy_(new[src : src + n])  # converts to the pool's dtype as .to()
    if meta.rest_rows is not None and meta.rest_slots is not None:
        flat.index_copy_(0, meta.rest_slots, new.index_select(0, meta.rest_rows).to(flat.dtype))

"""Runs of consecutive page ids in each sequence's page table: read in place, not gathered.

A run of pages at consecutive device ids is one slice of the pool, so attention can read it as
a view; several runs are read one kernel each and merged by log-sum-exp (see attention.py).
A forward's new K/V rows are written the same way: one slice copy per run (write_plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Runs of consecutive pages read in place, one kernel each, merged by LSE: at most MAX_RUNS
# of them and at least MIN_RUN_TOKENS per run on average (one run always). Measured on CPU:
# a merged piece costs a kernel call, a gather a copy that grows with the context; 2 runs of
# 160 tokens tie with a gather, 4 of 80 lose, 4-8 of 512+ win.
MAX_RUNS, MIN_RUN_TOKENS = 8, 512


def page_runs(
    page_tables: list[torch.Tensor], ctx_lens: list[int], page_size: int
) -> list[list[tuple[int, int]] | None]:
    """Per sequence: its context's pages as runs of consecutive ids [(first id, pages), ...]
    in logical order; None where they are more than one run and too many or too short
    (MAX_RUNS, MIN_RUN_TOKENS): those are gathered instead.

    Vectorised over all sequences, two host reads, on the tables as given (the engine's are
    host tensors, so no device sync).
    """
    used = [
        t[: -(-c // page_size)].to(torch.long) for t, c in zip(page_tables, ctx_lens, strict=True)
    ]
    counts = [u.numel() for u in used]
    if not used or min(counts) == 0:
        return [None] * len(used)
    device = used[0].device
    flat = torch.cat([u.to(device) for u in used])  # [P] every sequence's used pages
    begin = torch.tensor([0, *counts[:-1]], device=device).cumsum(0)  # [S] offsets in flat
    breaks = torch.ones_like(flat, dtype=torch.bool)  # True where a new run starts
    breaks[1:] = flat[1:] != flat[:-1] + 1
    breaks[begin] = True
    seq_of = torch.repeat_interleave(
        torch.arange(len(used), device=device), torch.tensor(counts, device=device)
    )
    n_runs = torch.zeros(len(used), dtype=torch.long, device=device)
    n_runs.index_add_(0, seq_of, breaks.long())
    n_of = n_runs.tolist()
    keep = [
        n == 1 or (n <= MAX_RUNS and c * page_size >= n * MIN_RUN_TOKENS)
        for n, c in zip(n_of, counts, strict=True)
    ]
    if not any(keep):
        return [None] * len(used)
    at = breaks.nonzero().squeeze(1)  # [R] flat index of each run's first page
    bounds, firsts = [*at.tolist(), flat.numel()], flat[at].tolist()
    out: list[list[tuple[int, int]] | None] = []
    r = 0
    for n, ok in zip(n_of, keep, strict=True):
        out.append(
            [(firsts[i], bounds[i + 1] - bounds[i]) for i in range(r, r + n)] if ok else None
        )
        r += n
    return out


# A forward's new K/V rows go to the pool as one slice copy per span of consecutive flat slots
# of at least MIN_SPAN_ROWS rows (at most MAX_SPANS spans); the rest (decode tokens, scattered
# pages) by one index_copy_. Measured on CPU (2 cores, SmolLM2 shapes): index_copy_ of [1024, 3, 64]
# fp32 from a strided view 0.26-0.31 ms on one thread, the slice copy 0.08-0.09 ms; with two
# contended threads 4.4-4.8 ms against 0.03-0.63 ms.
MIN_SPAN_ROWS, MAX_SPANS = 16, 16


@dataclass(frozen=True)
class WritePlan:
    """Where one forward's T new K/V rows go in the flat pool [capacity * page, kv_heads, dim]."""

    spans: list[tuple[int, int, int]]  # (first flat slot, first row, rows): one slice copy each
    rest: torch.Tensor | None  # [R] host rows no span holds, left to index_copy_ (None: none)
    # no spans: every row is index_copy_'d (rest is then None, not all T rows)


def write_plan(
    page_tables: list[torch.Tensor],
    seq_lens: list[int],
    ctx_lens: list[int],
    tail: list[bool],
    page_size: int,
) -> WritePlan:
    """Spans of the new rows of every tail sequence (its rows at positions ctx-n .. ctx-1),
    read from its page table (host tensors in the engine: no device sync); rows outside a
    long enough span, of non-tail sequences, or beyond MAX_SPANS spans, are the rest."""
    spans: list[tuple[int, int, int]] = []
    row = 0
    for table, n, ctx, in_order in zip(page_tables, seq_lens, ctx_lens, tail, strict=True):
        if in_order and n >= MIN_SPAN_ROWS:
            spans += [s for s in _spans(table, n, ctx, page_size, row) if s[2] >= MIN_SPAN_ROWS]
        row += n
    if not spans or len(spans) > MAX_SPANS:
        return WritePlan([], None)
    covered = torch.zeros(row, dtype=torch.bool)  # [T] True = written by a span
    for _, first, rows in spans:
        covered[first : first + rows] = True
    rest = (~covered).nonzero().squeeze(1)  # [R]
    return WritePlan(spans, rest if rest.numel() else None)


def _spans(
    table: torch.Tensor, n: int, ctx: int, page: int, row0: int
) -> list[tuple[int, int, int]]:
    """(first flat slot, first row, rows) of each run of consecutive pages holding positions
    ctx-n .. ctx-1 of one sequence, whose first row is row0 of the forward."""
    first = ctx - n
    lo = first // page  # logical page of the first new position
    ids = table[lo : -(-ctx // page)].tolist()
    out, pos, i = [], first, 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        end = min(ctx, (lo + j + 1) * page)  # past the run's last position
        out.append((ids[i] * page + pos % page, row0 + pos - first, end - pos))
        pos, i = end, j + 1
    return out

"""Runs of consecutive page ids in each sequence's page table: read in place, not gathered.

A run of pages at consecutive device ids is one slice of the pool, so attention can read it as
a view; several runs are read one kernel each and merged by log-sum-exp (see attention.py).
"""

from __future__ import annotations

import torch

# Runs of consecutive pages read in place, one kernel each, merged by LSE: at most MAX_RUNS
# of them and at least MIN_RUN_TOKENS per run on average (one run always). Measured on CPU
# (notes/decode.md): a merged piece costs a kernel call, a gather a copy that grows with the
# context; 2 runs of 160 tokens tie with a gather, 4 of 80 lose, 4-8 of 512+ win.
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

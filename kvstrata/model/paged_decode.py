"""Batched decode attention read where the pages are (`_paged_decode.c`): one new token per
sequence (or a speculative verify's few rows, which share one read of the pages), sequences of
different lengths in one call, no gather copy of K/V.

Each context is cut into chunks of whole pages, one task per (sequence, chunk) over the torch
threads, merged by log-sum-exp, so one long sequence keeps both threads busy as well as many;
the chunk kernel runs in AVX-512, AVX2 or portable C, the best the CPU has (`isa`).

CPU only (fp32 or bf16 pools); attention.py takes this route for a forward whose every
sequence adds a few tokens at its end (a decode step, a speculative verify: AttnMeta.
rows_as_decode), and keeps its per-sequence routes for everything else (and for CUDA, behind
the same PagedAttention interface).
"""

from __future__ import annotations

import math

import torch

try:
    from kvstrata.model import _paged_decode as _native
except ImportError:  # not built (an old checkout): attention.py keeps its other routes
    _native = None

_KV_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """True where the native kernel is built."""
    return _native is not None


def isa() -> str:
    """The instruction set its chunk kernel runs with: "avx512", "avx2" or "portable"."""
    return _native.isa() if _native is not None else "not built"


def use_isa(name: str | None) -> None:
    """Run at most this build of the chunk kernel ("avx512", "avx2", "portable"), or (None) the
    best the CPU has: every build is tested on one machine. ValueError for one the CPU lacks."""
    if _native is not None:
        _native.use_isa(name)


def usable(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """True where paged_decode can run these tensors: CPU, contiguous fp32/bf16 pools."""
    return (
        _native is not None
        and q.device.type == "cpu"
        and k_pool.device.type == "cpu"
        and k_pool.dtype in _KV_DTYPES
        and v_pool.dtype == k_pool.dtype
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
    )


def flat_tables(page_tables: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's page table in one int64 tensor [P] and each one's start [S]."""
    counts = [t.numel() for t in page_tables]
    starts = torch.tensor([0, *counts[:-1]], dtype=torch.long).cumsum(0)
    flat = torch.cat([t.to(torch.long) for t in page_tables]).contiguous()
    return flat, starts


def paged_decode(
    q: torch.Tensor,  # [S * rows, heads, dim] each sequence's rows in turn
    k_pool: torch.Tensor,  # [capacity, page_size, kv_heads, dim] one layer's keys
    v_pool: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],  # flat_tables(page_tables)
    ctx_lens: torch.Tensor,  # [S] int64: positions 0 .. ctx-1 visible to the last row
    chunk_pages: int = 0,
    rows: int = 1,
) -> torch.Tensor:  # [S * rows, heads, dim] in q's dtype
    """Softmax(q K^T / sqrt(dim)) V of each sequence's `rows` query rows from the pages, row r
    seeing positions 0 .. ctx - rows + r (a verify's causal rule; rows 1: a decode step over the
    whole context), the pages read once for all of them; each context in chunks of
    `chunk_pages` pages (0: the kernel chooses by the batch)."""
    if _native is None:
        raise RuntimeError("kvstrata.model._paged_decode is not built: run `pip install -e .`")
    t, heads, dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    qf = q.to(torch.float32).contiguous()
    if rows > 1:  # a sequence's rows become more query heads of each K/V head's group
        qf = _by_kv_head(qf, rows, kv_heads).contiguous()  # [S, kv_heads, rows, group, dim]
    out = torch.empty_like(qf)
    flat, starts = tables
    lens = ctx_lens.to(torch.long).contiguous()
    _native.decode(
        out.data_ptr(), qf.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        flat.data_ptr(), starts.data_ptr(), lens.data_ptr(),
        t // rows, heads, kv_heads, dim, page, k_pool.dtype == torch.bfloat16,
        1.0 / math.sqrt(dim), torch.get_num_threads(), chunk_pages, rows,
    )  # fmt: skip
    if rows > 1:  # [S, kv_heads, rows, group, dim] back to [S * rows, heads, dim]
        out = out.transpose(1, 2).reshape(t, heads, dim)
    return out.to(q.dtype)


def shares_rows(group: int, rows: int, dim: int) -> bool:
    """True where a sequence's `rows` rows run as one group of rows x group queries per K/V
    head (one read of the pages): unless that many fall from a vector build to the portable
    one, which costs more than reading the pages once per row in the vector build."""
    if _native is None:
        return False
    shared = _native.build_for(group * rows, dim)
    return shared != "portable" or _native.build_for(group, dim) == "portable"


def _by_kv_head(q: torch.Tensor, rows: int, kv_heads: int) -> torch.Tensor:
    """[S * rows, heads, dim] viewed as [S, kv_heads, rows, group, dim] (not contiguous)."""
    t, heads, dim = q.shape
    return q.view(t // rows, rows, kv_heads, heads // kv_heads, dim).transpose(1, 2)

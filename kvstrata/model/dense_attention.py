"""A prefill chunk's attention over its whole context by oneDNN matmuls (CPU, fp32).

torch's CPU flash-attention kernel runs its small matrix products through MKL's sgemm, which on
an AMD CPU takes a slower code path: measured on this project's 2-core EPYC (AVX-512), one
thread, SmolLM2's head shapes, sgemm gave 36-63 GFLOP/s where oneDNN's matmul over the same
operands gave 120-150. Here each K/V head's query group is one matrix (the group's heads of a
block of query rows stacked as rows, so GQA heads are never repeated): scores = Q K^T by one
oneDNN product, a causal mask on the block's diagonal keys, a row softmax, then P V by a second
product. Exact softmax attention (no running log-sum-exp): equal to the flash kernel's output
to float tolerance. The softmax's exp pass and the mask are one native pass over the scores
(`_causal_softmax.c`, AVX-512/AVX2 chosen at run time): rows left unnormalised, P V divided by
each row's sum after (one pass fewer); without the native module, torch's masked softmax.

Operands are copied dense per head (oneDNN reads a strided matrix orders of magnitude slower);
the copies are O(context) per head, the products O(rows x context). Memory per call: one block
of scores, at most SCORE_ELEMENTS floats, and one head's K and V of the context; contexts longer
than MAX_CONTEXT stay on the flash kernel's blocked route.
"""

from __future__ import annotations

import torch

SCORE_ELEMENTS = 1 << 19
"""Most scores (query rows x keys, fp32) one block holds: 2 MiB (measured best of 256 KiB to
8 MiB with SmolLM2's heads, 256 new tokens over 2048 cached, one thread)."""
MAX_ROWS = 64
"""Most query tokens per block (64 measured ahead of 256; the causal diagonal block computes
about half its square for nothing)."""
PARALLEL_SCORES = 1 << 20
"""Fewest scores whose exp pass is split over torch's threads (smaller blocks run on one)."""
MAX_CONTEXT = 32768
"""Longest context this route takes (one head's K and V copied dense: 16 MiB at head_dim 64)."""

_linear = torch.ops.mkldnn._linear_pointwise if hasattr(torch.ops, "mkldnn") else None

try:
    from kvstrata.model import _causal_softmax as _native
except ImportError:  # not built (an old checkout): torch's softmax
    _native = None


def isa() -> str:
    """The instruction set the softmax pass runs with: "avx512", "avx2", "portable" or "torch"."""
    return _native.isa() if _native is not None else "torch"


def use_portable(flag: bool) -> None:
    """Run the native pass's portable loop even where the CPU has AVX (True), or choose by the
    CPU again (False): every build is tested on one machine."""
    if _native is not None:
        _native.use_portable(flag)


MAX_THREADS = 1
"""Most torch threads this route runs at. Each block is ~5 small ops, each an OpenMP parallel
region (~60 per layer against the flash kernel's 2); on a machine running more threads than
cores, a region whose peer thread lost its core waits while libgomp spins: measured on 2 busy
cores (load 7) at 2 threads, 4-5x slower than the flash kernel (with OMP_WAIT_POLICY=PASSIVE,
1.1-1.6x faster). One thread has no peer to wait for."""


def usable(q: torch.Tensor, ctx: int) -> bool:
    """True where this route runs: CPU fp32 queries, oneDNN built, context <= MAX_CONTEXT,
    at most MAX_THREADS torch threads."""
    return (
        _linear is not None
        and torch.backends.mkldnn.is_available()
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and ctx <= MAX_CONTEXT
        and torch.get_num_threads() <= MAX_THREADS
    )


def _mm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ w [n, k].T -> [m, n] by oneDNN (both dense row-major)."""
    return _linear(x, w, None, "none", [], "")  # type: ignore[misc]


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x as a dense row-major fp32 tensor (one copy, converting a bf16 pool's rows)."""
    if x.dtype == torch.float32 and x.is_contiguous():
        return x
    return torch.empty(x.shape, dtype=torch.float32).copy_(x)


def block_rows(n: int, ctx: int, group: int) -> int:
    """Query tokens per block: the scores of `group` heads over `ctx` keys within
    SCORE_ELEMENTS, at most MAX_ROWS, at least 16 (or n)."""
    return min(n, max(16, min(MAX_ROWS, SCORE_ELEMENTS // max(1, group * ctx))))


def chunk_attention(
    q: torch.Tensor,  # [n, heads, dim] fp32, queries of positions ctx-n .. ctx-1
    keys: torch.Tensor,  # [ctx, kv_heads, dim] the whole context (any strides, fp32 or bf16)
    values: torch.Tensor,  # [ctx, kv_heads, dim]
    scale: float,
) -> torch.Tensor:  # [n, heads, dim] fp32
    """Softmax(q K^T * scale) V where query i sees keys 0 .. ctx-n+i (causal over the chunk,
    every cached key visible)."""
    n, heads, dim = q.shape
    ctx, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    out = torch.empty(n, kv_heads, group, dim)
    rows = block_rows(n, ctx, group)
    # diagonal mask of a full block: token j of the block may not see block key c > j
    above = torch.ones(rows, rows, dtype=torch.bool).triu_(1)[:, None, :]  # [rows, 1, rows]
    for g in range(kv_heads):
        qg = (q[:, g * group : (g + 1) * group] * scale).view(n * group, dim)  # rows (i, head)
        k = _dense(keys[:, g])  # [ctx, dim]: a block's keys are its first rows
        vt = _dense(values[:, g].t())  # [dim, ctx]: a block's values are a column slice
        for a in range(0, n, rows):
            b = min(a + rows, n)
            m, seen = b - a, ctx - n + b  # keys 0 .. seen-1 reach this block
            s = _mm_t(qg[a * group : b * group], k[:seen])  # [m * group, seen]
            p, sums = _causal_softmax(s, m, above[:m, :, :m])
            v = vt if seen == ctx else vt[:, :seen].contiguous()  # row copies, no gather
            o = _mm_t(p, v)  # [m * group, dim]
            out[a:b, g] = (o if sums is None else o.div_(sums[:, None])).view(m, group, dim)
    return out.view(n, heads, dim)


def _causal_softmax(
    s: torch.Tensor,  # [m * group, seen] scores of a block's m tokens, rows (token, head)
    m: int,
    above: torch.Tensor,  # [m, 1, m] bool, True where block token j may not see block key c
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token j of the block sees keys 0 .. seen-m+j. Natively: e^(s - row max) in place, 0
    where masked, and the row sums [m * group] to divide P V by; else torch's softmax, None."""
    rows, seen = s.shape
    if _native is not None:
        sums = torch.empty(rows)
        # a block's pass is ~0.1 ms: split over threads, its fork and join would cost more
        threads = 1 if s.numel() < PARALLEL_SCORES else torch.get_num_threads()
        _native.exp_rows(s.data_ptr(), sums.data_ptr(), rows, seen, m, threads)
        return s, sums
    s.view(m, rows // m, seen)[:, :, seen - m :].masked_fill_(above, float("-inf"))
    return torch.softmax(s, dim=-1), None

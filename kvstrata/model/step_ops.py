"""A decode step's small per-row ops in one native pass each (`_step_ops.c`).

At a decode step's few rows ([8, 576] for SmolLM2 at batch 8) torch's ops cost their dispatch
and temporaries, not their arithmetic: rms_norm took ~11 us per call alone and far more inside
a step (its composite path: pow, mean, add, rsqrt, mul), the rotary ~21 us (cat, neg, 3 muls),
the K/V write one copy per sequence, and argmax ~90 us per 49152-wide row. Each op here is one
call over the rows with the same arithmetic (see the C file for the exact roundings); callers
fall back to torch where `fits` says no (autograd, another device or dtype, a strided tensor).
"""

from __future__ import annotations

import torch

try:
    from kvstrata.model import _step_ops as _native
except ImportError:  # not built (an old checkout): torch's ops everywhere
    _native = None

_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """True where the native ops are built."""
    return _native is not None


def fits(*tensors: torch.Tensor) -> bool:
    """True where the native ops take these tensors: built, CPU, contiguous, fp32 or bf16 values
    (int64 indices), no autograd (the ops write outputs torch cannot differentiate)."""
    if _native is None:
        return False
    for t in tensors:  # a loop, not all(genexpr): called ~6 times a layer
        if t.device.type != "cpu" or t.requires_grad or not t.is_contiguous():
            return False
        if t.dtype not in _DTYPES and t.dtype != torch.long:
            return False
    return True


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s) * weight) with s = x + residual (a new tensor; x itself without one), over
    the last dim (x [..., hidden], weight [hidden], one dtype; the caller checked `fits`)."""
    n = weight.numel()
    if x.dtype != weight.dtype or x.dtype not in _DTYPES or x.shape[-1] != n:
        raise ValueError(f"rms_norm: x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} [{n}]")
    y = torch.empty_like(x)
    s = x if residual is None else torch.empty_like(x)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    r_at = 0 if residual is None else residual.data_ptr()
    _native.rms_norm(
        y.data_ptr(), x.data_ptr(), r_at, 0 if residual is None else s.data_ptr(),
        weight.data_ptr(), x.numel() // n, n, eps, x.dtype == torch.bfloat16,
    )  # fmt: skip
    return s, y


def rope_write(
    qkv: torch.Tensor,  # [T, heads + 2 kv_heads, dim] the fused projection, unrotated
    cos: torch.Tensor,  # [T, dim] model dtype
    sin: torch.Tensor,
    heads: int,
    k_flat: torch.Tensor,  # [slots, kv_heads, dim] one layer's pool, any of fp32/bf16
    v_flat: torch.Tensor,
    slots: torch.Tensor,  # [T] int64 flat slot of each row
) -> torch.Tensor:  # [T, heads, dim] rotated queries
    """Rotate q and k (rotate-half), write k and v to the pool at `slots`; returns q. The caller
    checked `fits` for every tensor and the slots' range (the pool's own index checks)."""
    t, width, dim = qkv.shape
    kv = k_flat.shape[1]
    if width != heads + 2 * kv or k_flat.shape[2] != dim or cos.shape != (t, dim):
        raise ValueError(f"rope_write: qkv {tuple(qkv.shape)}, pool {tuple(k_flat.shape)}")
    if v_flat.shape != k_flat.shape or v_flat.dtype != k_flat.dtype or slots.shape != (t,):
        raise ValueError("rope_write: k/v pools differ or slots are not one per row")
    if slots.dtype != torch.long or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise ValueError("rope_write: slots must be int64, cos/sin in the model dtype")
    if qkv.dtype not in _DTYPES or k_flat.dtype not in _DTYPES:
        raise ValueError(f"rope_write: {qkv.dtype} projection, {k_flat.dtype} pool")
    q = torch.empty(t, heads, dim, dtype=qkv.dtype)
    _native.rope_write(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k_flat.data_ptr(),
        v_flat.data_ptr(), slots.data_ptr(), t, heads, kv, dim, qkv.dtype == torch.bfloat16,
        k_flat.dtype == torch.bfloat16,
    )  # fmt: skip
    return q


def argmax(row: torch.Tensor) -> int:
    """int(torch.argmax(row)) of a logits row (flattened): the first largest, the first NaN if
    any; natively for a contiguous CPU fp32 row."""
    if row.dtype != torch.float32 or not fits(row) or row.numel() == 0:
        return int(torch.argmax(row))
    return _native.argmax(row.data_ptr(), row.numel())

"""Linears over a few rows (a decode step's tokens) by the native `_small_matmul` kernel.

At a few rows a linear is bound by reading its weight once; the kernel streams the plain
[out, in] weight front to back and meets every row of x on the way (fp32 sums, fp32 or bf16
weights and activations; AVX-512, AVX2 or portable inner loop, chosen at run time). Measured on
2-core machines with SmolLM2's shapes, weights cycling through 30 layers as in a step: in bf16
it takes ~0.5 of torch's bf16 F.linear time at 8 rows, 0.8 at 1 row (AVX-512 Xeon: 42 vs 84 ms
a step's layers at 8 rows, 1 thread; torch has no native bf16 matmul on a CPU without
AVX512-BF16/AMX). In fp32 oneDNN's prepacked linear is ahead of it at 8-32 rows on the AVX-512
Xeon (42 vs 58 ms at 8 rows) and on par at 1, so fp32 models run prepacked (prepack.py); the
kernel serves the fp32 linears that are not packed. Larger inputs (prefill) go to torch.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from kvstrata.model import _small_matmul as _native
except ImportError:  # not built (an old checkout): torch's linear everywhere
    _native = None

MAX_ROWS = {torch.float32: 16, torch.bfloat16: 32}
"""Most rows of x the kernel takes, by dtype; beyond them torch's blocked matmuls win
(compute-bound). Measured with SmolLM2's shapes (AVX-512 Xeon, 1 thread): fp32 at 32 rows
the kernel took 110 ms a step's layers vs F.linear's 92; bf16 at 32 rows 116 vs the fp32
upcast's 126 (24 rows: 100 vs 126; 48: 177 vs 158), the LM head 31 vs 84."""


def isa() -> str:
    """The instruction set the kernel's inner loop runs with: "avx512", "avx2" or "portable"."""
    return _native.isa() if _native is not None else "not built"


def use_isa(name: str) -> None:
    """Run the best inner loop up to `name` ("portable", "avx2", "avx512": the CPU's best) from
    now on: every build is tested on one machine."""
    if _native is not None:
        _native.use_isa(name)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where the kernel runs y = x @ weight.T: CPU, at most MAX_ROWS[dtype] rows, fp32 or
    bf16 (x and weight the same dtype), plain contiguous tensors (not a released placeholder)."""
    return (
        _native is not None
        and x.dim() == 2
        and x.dtype == weight.dtype
        and x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_contiguous()
        and not weight.requires_grad
    )


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ weight [out, in].T + bias [out] -> [M, out] in x's dtype, by the kernel
    (see `fits`; the caller checked it)."""
    m, k = x.shape
    n = weight.shape[0]
    if k != weight.shape[1]:
        raise ValueError(f"small_linear: x has {k} columns, the weight {weight.shape[1]}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    bf16 = x.dtype == torch.bfloat16
    _native.matmul(
        y.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if b is None else b.data_ptr(),
        m, n, k, bf16, bf16, bf16, torch.get_num_threads(),
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel where it `fits`; bf16 over more rows on a
    CPU without native bf16 matmuls in fp32 (see `upcast_linear`)."""
    if fits(x, weight):
        return small_linear(x, weight, bias)
    if _upcasts(x, weight):
        return upcast_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; a plain nn.Linear over few rows through the kernel, bf16 prefill rows as
    `linear` (anything else, e.g. a tensor-parallel or prepacked linear, runs its own forward)."""
    weight = getattr(module, "weight", None)  # a released placeholder is on meta: never taken
    if type(module) is nn.Linear and (fits(x, weight) or _upcasts(x, weight)):
        return linear(x, weight, module.bias)
    return module(x)


def _native_bf16() -> bool:
    """torch has bf16 matmul instructions here (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


NATIVE_BF16 = _native_bf16()


def _upcasts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        not NATIVE_BF16
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
    )


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 F.linear as fp32 on upcast copies, rounded once to bf16. Without AVX512-BF16/AMX,
    torch's bf16 matmul is ~11x slower than fp32 at 256 rows (SmolLM2 gate_up, 1 thread: 301 vs
    27 ms with the upcasts); bf16 products are exact in fp32, so only the summation order
    differs from an fp32-accumulating bf16 matmul."""
    b = None if bias is None else bias.float()
    return nn.functional.linear(x.float(), weight.float(), b).to(torch.bfloat16)

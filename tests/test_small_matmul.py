"""The native few-row linear (model/_small_matmul.c) against a float64 reference, and where
the model takes it: fp32 and bf16 weights and activations, bias, a column count that is not a
multiple of 8 or 16, an odd row count of W, 1..17 rows (tiles of 8 and their tails), 1 and 2
threads; every inner loop this CPU can run (AVX-512, AVX2, portable), each capped to in turn."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from kvstrata.model import small_matmul as sm
from tests.tiny_models import rel_err

torch.set_num_threads(1)


ISAS = ("portable", "avx2", "avx512")  # worst to best


def test_kernel_is_built() -> None:
    assert sm.isa() in ISAS


@pytest.fixture(params=ISAS)
def build(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each inner loop up to the CPU's best (one this CPU lacks is skipped)."""
    best = sm.isa()
    if ISAS.index(request.param) > ISAS.index(best):
        pytest.skip(f"this CPU runs {best}, not {request.param}")
    sm.use_isa(request.param)
    try:
        yield sm.isa()
    finally:
        sm.use_isa("avx512")


def test_the_inner_loop_can_be_capped() -> None:
    best = sm.isa()
    sm.use_isa("portable")
    try:
        assert sm.isa() == "portable"
    finally:
        sm.use_isa("avx512")
    assert sm.isa() == best
    with pytest.raises(ValueError, match="unknown"):
        sm.use_isa("sse9")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_float64_reference(
    dtype: torch.dtype, rows: int, threads: int, bias: bool, build: str
) -> None:
    gen = torch.Generator().manual_seed(rows)
    out_f, in_f = 37, 203  # a block tail, an odd W row; 203 % 8 = 3, % 16 = 11 tail columns
    w = torch.randn(out_f, in_f, generator=gen).to(dtype)
    b = torch.randn(out_f, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    assert sm.fits(x, w) and sm.isa() == build
    torch.set_num_threads(threads)
    try:
        y = sm.small_linear(x, w, b)
    finally:
        torch.set_num_threads(1)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.dtype == dtype and y.shape == (rows, out_f)
    # fp32: summation order only; bf16: one rounding of the fp32 sum to bf16 (2^-8 relative)
    assert rel_err(y.double(), ref) <= (1e-6 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("rows", [25, 32])
def test_bf16_takes_more_rows(rows: int, build: str) -> None:
    """bf16 up to MAX_ROWS[bf16] rows (four passes of 8 over each block of W)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(37, 203, generator=gen).bfloat16()
    x = torch.randn(rows, 203, generator=gen).bfloat16()
    assert sm.fits(x, w) and not sm.fits(x.float(), w.float())
    ref = x.double() @ w.double().T
    assert rel_err(sm.small_linear(x, w, None).double(), ref) <= 4e-3


def test_bf16_equals_torch_bf16_linear_to_its_rounding() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 576, generator=gen).bfloat16()
    x = torch.randn(8, 576, generator=gen).bfloat16()
    got, want = sm.small_linear(x, w, None), nn.functional.linear(x, w)
    assert (got.float() - want.float()).abs().max() <= 2 * 2**-8 * want.float().abs().max()


def test_fits_only_few_cpu_rows_of_one_dtype() -> None:
    w = torch.zeros(4, 8)
    assert sm.fits(torch.zeros(sm.MAX_ROWS[torch.float32], 8), w)
    assert not sm.fits(torch.zeros(sm.MAX_ROWS[torch.float32] + 1, 8), w)  # prefill: torch's
    bf = w.bfloat16()
    assert sm.fits(torch.zeros(sm.MAX_ROWS[torch.bfloat16], 8).bfloat16(), bf)
    assert not sm.fits(torch.zeros(sm.MAX_ROWS[torch.bfloat16] + 1, 8).bfloat16(), bf)
    assert not sm.fits(torch.zeros(2, 8, dtype=torch.float64), w.double())
    assert not sm.fits(torch.zeros(2, 8).bfloat16(), w)  # mixed dtypes
    assert not sm.fits(torch.zeros(2, 8), torch.zeros(8, 4).T)  # a transposed view
    assert not sm.fits(torch.zeros(2, 8), torch.zeros(4, 8, device="meta"))  # released weight


def test_run_takes_plain_linears_only() -> None:
    lin = nn.Linear(8, 4).requires_grad_(False)
    x = torch.randn(2, 8)
    assert rel_err(sm.run(lin, x), lin(x)) <= 1e-6
    seq = nn.Sequential(lin)  # anything else runs its own forward
    assert torch.equal(sm.run(seq, x), seq(x))
    with pytest.raises(ValueError, match="columns"):
        sm.small_linear(torch.zeros(1, 7), torch.zeros(4, 8), None)


def test_bf16_prefill_rows_run_in_fp32_on_upcasts() -> None:
    gen = torch.Generator().manual_seed(6)
    lin = nn.Linear(203, 37).bfloat16().requires_grad_(False)
    x = torch.randn(sm.MAX_ROWS[torch.bfloat16] + 5, 203, generator=gen).bfloat16()  # prefill
    want = nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    exact = want.bfloat16()  # the exact sum rounded once
    for got in (sm.upcast_linear(x, lin.weight, lin.bias), sm.run(lin, x)):
        assert got.dtype == torch.bfloat16
        assert (got.float() - exact.float()).abs().max() <= 2**-8 * want.abs().max()
    torch_bf16 = lin(x)  # torch's own bf16 matmul: equal to its rounding
    assert (sm.run(lin, x).float() - torch_bf16.float()).abs().max() <= 2 * 2**-8 * want.abs().max()

"""A decode step's native ops (model/step_ops.py) against the torch ops they replace: rms norm
with and without the residual add (fp32 to float tolerance, bf16 to its rounding), the rotary
and K/V write bit for bit (fp32 and bf16 models, fp32 and bf16 pools), argmax exactly (ties,
NaN, infinities, rows not a multiple of the scan block), and the cases that fall back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvstrata.model import step_ops
from kvstrata.model.layers import RMSNorm, Rotary, apply_rotary
from tests.tiny_models import rel_err

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not step_ops.available(), reason="_step_ops is not built")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' arithmetic: normalised in fp32, rounded to x's dtype, then the weight."""
    h = nn.functional.rms_norm(x.float(), w.shape, None, eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_fp32_equals_float64(residual: bool) -> None:
    x, h, w = randn(8, 576, seed=1), randn(8, 576, seed=2), randn(576, seed=3)
    s, y = step_ops.rms_norm(x, w, 1e-5, h if residual else None)
    want_s = x + h if residual else x
    assert torch.equal(s, want_s)  # the sum as torch's fp32 add
    d = want_s.double()
    ref = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert rel_err(y.double(), ref) <= 1e-6


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_bf16_equals_transformers_to_its_rounding(residual: bool) -> None:
    bf = torch.bfloat16
    x, h, w = randn(5, 200, seed=4, dtype=bf), randn(5, 200, seed=5, dtype=bf), randn(200, seed=6)
    w = w.to(bf)
    s, y = step_ops.rms_norm(x, w, 1e-6, h if residual else None)
    want_s = x + h if residual else x
    assert s.dtype == y.dtype == bf and torch.equal(s, want_s)  # bf16 add: one rounding
    want = torch_norm(want_s, w, 1e-6)
    # only the fp32 mean's summation order differs: at most one bf16 step apart
    step = want.float().abs() * 2**-7
    assert ((y.float() - want.float()).abs() <= step).all()


def test_rms_norm_module_and_add_norm_take_it_where_it_fits() -> None:
    norm = RMSNorm(64, 1e-5, torch.float32).requires_grad_(False)
    norm.weight.copy_(randn(64, seed=7))
    x, h = randn(3, 64, seed=8), randn(3, 64, seed=9)
    s, y = norm.add_norm(x, h)
    assert torch.equal(s, x + h) and rel_err(y, torch_norm(x + h, norm.weight, 1e-5)) <= 1e-6
    assert s.data_ptr() != x.data_ptr()  # the caller's x is not written
    strided = randn(64, 3, seed=10).T  # not contiguous: torch's kernel
    assert not step_ops.fits(strided)
    assert rel_err(norm(strided), torch_norm(strided, norm.weight, 1e-5)) <= 1e-6
    graph = x.clone().requires_grad_(True)  # autograd: torch's ops, differentiable
    assert not step_ops.fits(graph) and norm(graph).requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_rope_write_equals_rotary_and_pool_write(
    dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    t, heads, kv, dim = 5, 6, 2, 32
    qkv = randn(t, heads + 2 * kv, dim, seed=11, dtype=dtype)
    cos, sin = Rotary(dim, 10000.0, None).tables(torch.tensor([0, 3, 17, 40, 41]), dtype)
    k_flat = torch.zeros(50, kv, dim, dtype=pool_dtype)
    v_flat = torch.zeros_like(k_flat)
    slots = torch.tensor([7, 0, 49, 12, 13])
    q = step_ops.rope_write(qkv, cos, sin, heads, k_flat, v_flat, slots)
    qk = apply_rotary(qkv[:, : heads + kv], cos, sin)  # the torch route, one rotation
    assert q.dtype == dtype and q.is_contiguous() and torch.equal(q, qk[:, :heads])
    assert torch.equal(k_flat[slots], qk[:, heads:].to(pool_dtype))
    assert torch.equal(v_flat[slots], qkv[:, heads + kv :].to(pool_dtype))
    others = torch.ones(50, dtype=torch.bool)
    others[slots] = False
    assert not k_flat[others].any() and not v_flat[others].any()  # nothing else written


def test_rope_write_refuses_mismatched_shapes() -> None:
    qkv = torch.zeros(2, 8, 16)
    cos = sin = torch.zeros(2, 16)
    pool = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="qkv"):
        step_ops.rope_write(qkv, cos, sin, 5, pool, pool.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slots"):
        step_ops.rope_write(qkv, cos, sin, 4, pool, pool.clone(), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 49152])
def test_argmax_equals_torch(n: int) -> None:
    row = randn(n, seed=n)
    assert step_ops.argmax(row) == int(torch.argmax(row))
    row[n // 3] = row[(2 * n) // 3] = float("inf")  # ties: the first
    assert step_ops.argmax(row) == int(torch.argmax(row)) == n // 3
    row[n - 1] = float("nan")  # NaN counts as the largest
    assert step_ops.argmax(row) == int(torch.argmax(row)) == n - 1


def test_argmax_edge_rows() -> None:
    assert step_ops.argmax(torch.full((100,), float("-inf"))) == 0
    row = torch.zeros(130)
    row[5], row[77] = float("nan"), float("nan")
    assert step_ops.argmax(row) == int(torch.argmax(row)) == 5
    two_d = randn(1, 300, seed=12)  # a [1, vocab] logits row: the flat index
    assert step_ops.argmax(two_d) == int(torch.argmax(two_d))
    half = randn(300, seed=13).bfloat16()  # not fp32: torch's argmax
    assert step_ops.argmax(half) == int(torch.argmax(half))

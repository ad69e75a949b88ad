"""dense_attention.chunk_attention against softmax attention computed in fp64."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import kvstrata.model.dense_attention as dense
from kvstrata.model.dense_attention import block_rows, chunk_attention, isa, usable, use_portable

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def native_by_cpu() -> Iterator[None]:
    """Every test leaves the native pass choosing its loop by the CPU."""
    yield
    use_portable(False)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """fp64 softmax attention, query i of n seeing keys 0 .. ctx-n+i  # [n, heads, dim]"""
    n, heads, dim = q.shape
    ctx, kv_heads = keys.shape[:2]
    group = heads // kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # [ctx, heads, dim]
    v = values.double().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,chd->hnc", q.double(), k) / dim**0.5  # [heads, n, ctx]
    seen = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]  # [n, ctx]
    p = s.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hnc,chd->nhd", p, v)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(
    ("n", "prefix", "heads", "kv_heads"),
    [(1, 0, 4, 2), (23, 0, 4, 2), (37, 0, 9, 3), (20, 13, 9, 3), (5, 40, 4, 1), (16, 16, 2, 2)],
)
@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.parametrize("softmax", ["native", "portable", "torch"])
def test_chunk_attention_equals_reference(
    n: int,
    prefix: int,
    heads: int,
    kv_heads: int,
    small_blocks: bool,
    softmax: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Causal over the chunk, every prefix key visible, grouped heads; small_blocks: query
    blocks of 16 rows, so the diagonal mask and the column slices of later blocks are used;
    softmax: the native pass as the CPU chooses it, its portable loop, or torch's."""
    if small_blocks:
        monkeypatch.setattr(dense, "MAX_ROWS", 16)
    if softmax == "torch":
        monkeypatch.setattr(dense, "_native", None)
    elif dense._native is None:
        pytest.skip("kvstrata.model._causal_softmax is not built")
    use_portable(softmax == "portable")
    g = torch.Generator().manual_seed(n * 100 + prefix)
    dim, ctx = 16, prefix + n
    q = torch.randn(n, heads, dim, generator=g)
    # keys and values as strided views, as the pool and the fused q|k|v output give them
    kv = torch.randn(ctx, 2 * kv_heads + 1, dim, generator=g)
    keys, values = kv[:, :kv_heads], kv[:, kv_heads : 2 * kv_heads]
    out = chunk_attention(q, keys, values, dim**-0.5)
    assert out.shape == (n, heads, dim) and out.dtype == torch.float32
    assert rel(out, reference(q, keys, values)) <= 1e-5


def test_native_pass_reports_its_isa() -> None:
    assert isa() in (("torch",) if dense._native is None else ("avx512", "avx2", "portable"))


def test_bf16_keys_are_read_as_stored() -> None:
    """A bf16 pool's K/V: attention over their fp32 values (the rounding the pool applied)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(9, 6, 32, generator=g)
    keys = torch.randn(30, 2, 32, generator=g).to(torch.bfloat16)
    values = torch.randn(30, 2, 32, generator=g).to(torch.bfloat16)
    out = chunk_attention(q, keys, values, 32**-0.5)
    assert rel(out, reference(q, keys.float(), values.float())) <= 1e-5


def test_blocks_bound_the_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Query rows per block: at most MAX_ROWS, scores within SCORE_ELEMENTS, at least 16."""
    assert block_rows(1000, 1000, 3) == dense.MAX_ROWS
    assert block_rows(5, 100, 3) == 5
    monkeypatch.setattr(dense, "SCORE_ELEMENTS", 3 * 32 * 1000)
    assert block_rows(1000, 1000, 3) == 32
    assert block_rows(1000, 10**6, 3) == 16


def test_usable_only_for_cpu_fp32_within_the_context_and_thread_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q = torch.zeros(2, 4, 8)
    assert usable(q, 100) == torch.backends.mkldnn.is_available()  # one thread (module top)
    assert not usable(q.to(torch.bfloat16), 100)
    assert not usable(q, dense.MAX_CONTEXT + 1)
    monkeypatch.setattr(dense, "MAX_THREADS", 0)
    assert not usable(q, 100)

"""A cp rank's split attention (prefix unmasked + chunk biased, merged by LSE) equals the
general masked attention over the whole context, for the rank's own scattered query rows."""

from __future__ import annotations

import torch

from kvstrata.model.attn_meta import build_meta
from kvstrata.model_parallel.cp_attn import attend_owned, chunk_bias


def _case(prefix: int, n: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(prefix + n)
    ctx, page = prefix + n, 4
    table = torch.arange(-(-ctx // page))
    meta = build_meta(torch.arange(prefix, ctx), [n], [ctx], [table], page)
    assert meta.tail == [True]
    r = torch.tensor(rows)
    q = torch.randn(len(rows), 4, 8)  # [t, heads, dim]: 2 query heads per K/V head
    k, v = torch.randn(ctx, 2, 8), torch.randn(ctx, 2, 8)
    got = attend_owned(q, k, v, meta, 0, r, gqa=True, bias={})
    meta.tail[0] = False  # force the general masked path over [t, ctx]
    ref = attend_owned(q, k, v, meta, 0, r, gqa=True)
    return got, ref


def test_split_equals_masked_with_a_prefix() -> None:
    got, ref = _case(prefix=37, n=16, rows=[0, 1, 2, 3, 8, 9, 10, 11, 15])
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_split_equals_masked_first_chunk() -> None:
    got, ref = _case(prefix=0, n=12, rows=[4, 5, 6, 7])
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_chunk_bias_is_causal_by_row() -> None:
    bias = chunk_bias(torch.tensor([0, 2]), 3, torch.float32)
    inf = float("-inf")
    assert bias.tolist() == [[0.0, inf, inf], [0.0, 0.0, 0.0]]

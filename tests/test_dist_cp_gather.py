"""CP page ownership and the double-buffered layer gather on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from kvstrata.memory.cp_ownership import CPOwnership
from kvstrata.model_parallel.cp_gather import CPGather, make_plan, scratch_nbytes
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.group import RankContext, run_ranks

torch.set_num_threads(1)

SHAPE = (3, 2, 12, 4, 2, 3)  # [num_layers, 2, capacity, page_size, kv_heads, head_dim]
BATCHES = (
    [5, 0, 7, 2, 9, 4, 11],  # unbalanced: rank 1 owns 4, rank 0 owns 3
    [1, 3, 5],  # every page on rank 1: rank 0 packs nothing
    [8, 6, 4, 2, 0, 10],
)


def _full_pool() -> torch.Tensor:
    """The unsharded pool, identical on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(7)
    return torch.randn(SHAPE, generator=gen)  # [layers, 2, capacity, page, heads, dim]


def _gather_all(ctx: RankContext) -> int:
    full = _full_pool()
    own = CPOwnership(2)
    local = full[:, :, ctx.cp_rank :: 2].contiguous()  # slot j <-> page id 2*j + rank
    gather = CPGather(own, local, ctx.cp_rank, ctx.cp_group)
    checked = 0
    for ids in BATCHES:
        ptrs, previous = [], None
        for layer, kv in enumerate(gather.layers(ids)):  # kv: [2, n_pages, page, heads, dim]
            torch.testing.assert_close(kv, full[layer][:, ids], rtol=0, atol=0)
            if layer + 1 < SHAPE[0]:  # the next layer's gather is in flight during this one
                assert list(gather._pending) == [layer + 1], gather._pending
            if previous is not None:  # the other buffer is untouched until layer + 1 finishes
                torch.testing.assert_close(previous, full[layer - 1][:, ids], rtol=0, atol=0)
            ptrs.append(kv.data_ptr())
            previous = kv
            checked += 1
        assert ptrs[0] == ptrs[2] != ptrs[1]  # two scratch buffers alternate
    return checked


def test_gather_equals_unsharded_pool_on_two_ranks() -> None:
    results = run_ranks(_gather_all, DistConfig(cp=2, backend="gloo"), timeout_s=60)
    assert results == [SHAPE[0] * len(BATCHES)] * 2


def test_ownership_rule_and_plan() -> None:
    own = CPOwnership(3)
    assert [own.owner(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [own.slot(i) for i in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert all(own.page_id(own.owner(i), own.slot(i)) == i for i in range(50))
    assert own.owned([4, 3, 10, 7], 1) == ([0, 2, 3], [1, 3, 2])
    assert own.shares(list(range(9))) == [3, 3, 3]
    plan = make_plan(CPOwnership(2), [3, 0, 1], rank=1, device="cpu")
    assert plan.per_rank == 2 and plan.send_slots.tolist() == [1, 0]
    # recv rows [cp * 2 * m]: rank 0's K rows 0..1, V rows 2..3; rank 1's K rows 4..5, V 6..7
    assert plan.order.tolist() == [4, 0, 5, 6, 2, 7]
    assert scratch_nbytes(100, n_pages=3, per_rank=2, cp=2) == 2 * 2 * (3 + 4 + 2) * 100
    with pytest.raises(ValueError, match="cp"):
        CPOwnership(0)
    with pytest.raises(ValueError, match="local_kv"):
        CPGather(CPOwnership(2), torch.zeros(2, 2, 3), 0)

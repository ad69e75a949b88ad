"""The double-buffered per-layer context-parallel gather of a batch's KV.

Ownership is a fixed rule on the logical page id, with no lookup table
(kvstrata.memory.cp_ownership):
    owner = id % cp, local slot = id // cp
so each rank's device pool holds only its own pages, layer-first:
    local_kv  # [num_layers, 2, capacity_local, page_size, kv_heads, head_dim]

For each layer, attention needs every page of the batch in logical order (the page table). Each
rank packs its owned pages of the batch into a send buffer, one all_gather fills a receive buffer
with every rank's pack, and an index_select puts the pages in logical order into scratch:
    send     # [2, m, page_size, kv_heads, head_dim]       m = most pages any one rank owns
    recv     # [cp * 2, m, page_size, kv_heads, head_dim]  rank r's K at row 2r, V at 2r + 1
    scratch  # [2, n_pages, page_size, kv_heads, head_dim] logical order
Two (recv, scratch) pairs alternate across layers: the async gather of layer l+1 runs while
layer l computes on the other pair. The scheduler counts both pairs (`scratch_nbytes`) when it
decides whether a batch fits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvstrata.memory.cp_ownership import CPOwnership

# torch >= 2.12 names it all_gather_single; older releases all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class GatherPlan:
    """Index tensors for one batch, built once and reused by every layer."""

    n_pages: int
    per_rank: int  # m: pages per rank in the packed send buffer (max share; others padded)
    send_slots: torch.Tensor  # [n_owned] local slots this rank packs, in logical order
    order: torch.Tensor  # [2 * n_pages] rows of recv viewed as [cp * 2 * m, P]: K rows, then V


def make_plan(own: CPOwnership, page_ids: Sequence[int], rank: int, device: Any) -> GatherPlan:
    """Every rank derives the same layout of the packed buffers from the same page table."""
    m = max(own.shares(page_ids)) if page_ids else 0
    seen = [0] * own.cp
    k_rows = []
    for p in page_ids:
        r = own.owner(p)
        k_rows.append(r * 2 * m + seen[r])  # the seen[r]-th page packed by its owner, K half
        seen[r] += 1
    order = k_rows + [row + m for row in k_rows]  # V half sits m rows after K
    _, slots = own.owned(page_ids, rank)
    return GatherPlan(
        n_pages=len(page_ids),
        per_rank=m,
        send_slots=torch.tensor(slots, dtype=torch.long, device=device),
        order=torch.tensor(order, dtype=torch.long, device=device),
    )


def scratch_nbytes(layer_page_bytes: int, n_pages: int, per_rank: int, cp: int) -> int:
    """Memory of both buffer pairs for a batch: 2 x (scratch + recv + send), K and V."""
    pages = n_pages + cp * per_rank + per_rank
    return 2 * 2 * pages * layer_page_bytes


class CPGather:
    """Double-buffered layer-by-layer gather of a batch's pages over the cp group."""

    def __init__(self, own: CPOwnership, local_kv: torch.Tensor, rank: int, group: Any = None):
        if local_kv.dim() != 6 or local_kv.shape[1] != 2:
            raise ValueError(
                "local_kv must be [num_layers, 2, capacity_local, page, heads, dim], "
                f"got {tuple(local_kv.shape)}"
            )
        if not 0 <= rank < own.cp:
            raise ValueError(f"rank must be in [0, {own.cp}), got {rank}")
        self.own = own
        self.kv = local_kv
        self.rank = rank
        self.group = group
        self._page_shape = tuple(local_kv.shape[3:])  # (page_size, kv_heads, head_dim)
        self._bufs: list[dict[str, torch.Tensor]] = [{}, {}]
        self._pending: dict[int, Any] = {}

    def _buffer(self, idx: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Buffer `name` of pair `idx`, grown (never shrunk) to hold `shape`; a view of it."""
        numel = 1
        for d in shape:
            numel *= d
        buf = self._bufs[idx].get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=self.kv.dtype, device=self.kv.device)
            self._bufs[idx][name] = buf
        return buf[:numel].view(shape)

    def start(self, plan: GatherPlan, layer: int) -> None:
        """Pack this rank's pages of `layer` and launch the async all_gather into pair layer % 2."""
        idx = layer % 2
        m, cp = plan.per_rank, self.own.cp
        send = self._buffer(idx, "send", (2, m, *self._page_shape))
        n_owned = plan.send_slots.numel()
        torch.index_select(self.kv[layer], 1, plan.send_slots, out=send[:, :n_owned])
        recv = self._buffer(idx, "recv", (cp * 2, m, *self._page_shape))  # ranks' packs stacked
        work = _all_gather_single(recv, send, group=self.group, async_op=True)
        self._pending[layer] = work

    def finish(self, plan: GatherPlan, layer: int) -> torch.Tensor:
        """Wait for `layer`'s gather; its pages in logical order  # [2, n_pages, page, heads, dim]"""
        idx = layer % 2
        self._pending.pop(layer).wait()
        m, cp = plan.per_rank, self.own.cp
        rows = self._buffer(idx, "recv", (cp * 2 * m, *self._page_shape))  # same memory as recv
        scratch = self._buffer(idx, "scratch", (2 * plan.n_pages, *self._page_shape))
        torch.index_select(rows, 0, plan.order, out=scratch)
        return scratch.view(2, plan.n_pages, *self._page_shape)

    def layers(self, page_ids: Sequence[int]) -> Iterator[torch.Tensor]:
        """Yield each layer's gathered KV in logical order; layer l+1's gather is in flight while
        the caller computes layer l. A yielded tensor stays valid until layer l+2 is reached."""
        plan = make_plan(self.own, page_ids, self.rank, self.kv.device)
        n_layers = self.kv.shape[0]
        if not page_ids:  # every rank has the same page table: all skip the collectives
            for _ in range(n_layers):
                yield self.kv.new_empty((2, 0, *self._page_shape))
            return
        if n_layers:
            self.start(plan, 0)
        for layer in range(n_layers):
            if layer + 1 < n_layers:
                self.start(plan, layer + 1)
            yield self.finish(plan, layer)

"""The target's hidden state at a page's last position, kept inside the page.

A NextN/MTP draft's entry at position j takes the target's hidden state h_{j-1}. At the first
position of a page that state belongs to the previous page, and a prefix hit never computes
it; so every page carries h at its last position (before the final norm) in `layers` pool
layers of its own, after the draft's KV layers. A page id then names target KV, draft KV and
this state together, and every tier, copy, storage unit and P/D transfer moves all three with
no code of its own; a page stored without these layers lives under another page layout (and
namespace), so it is a miss, never a page whose draft reads a wrong state.

Packing: h [hidden] fills the pool's per-page slots in order, K then V of state layer 0, K then
V of layer 1, ...; each slot holds page_size * kv_heads * head_dim elements of the pool's
dtype (the target's: h is stored exactly). Unused elements stay zero.

Under context parallel a page lives on its owner (id % cp) only: the owner reads the state
and the cp group sums it (the other ranks contribute zeros), so every rank gets the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvstrata.memory.layout import KVShape


def state_layers(shape: KVShape, hidden_size: int) -> int:
    """Pool layers one hidden state [hidden_size] needs in pages of `shape` (K and V slots)."""
    slot = shape.page_size * shape.num_kv_heads * shape.head_dim
    return math.ceil(hidden_size / (2 * slot))


class PageStates:
    """Reads and writes the hidden-state layers [first, first + layers) of a pool's pages.

    `active` is False on a rank whose pool part lacks these layers (a pipeline stage before
    the last): it writes nothing and reads zeros (the draft never runs there). `group`: the
    cp group under context parallel (None otherwise)."""

    def __init__(self, first: int, layers: int, hidden_size: int) -> None:
        self.first, self.layers, self.hidden_size = first, layers, hidden_size
        self.active = True
        self.group: Any = None

    def _slots(self, pool: Any, slot: int) -> list[torch.Tensor]:
        """The flat per-page views [page_size * kv_heads * head_dim] of local slot `slot`."""
        out = []
        for i in range(self.first, self.first + self.layers):
            out += [pool.k(i)[slot].view(-1), pool.v(i)[slot].view(-1)]
        return out

    def write(self, pool: Any, page_id: int, h: torch.Tensor) -> None:
        """Store h [hidden] as page `page_id`'s state (on its owner rank)."""
        if not self.active or not _owns(pool, page_id):
            return
        left = h.reshape(-1)
        for view in self._slots(pool, _local(pool, page_id)):
            n = min(view.numel(), left.numel())
            view[:n].copy_(left[:n])
            left = left[n:]
            if not left.numel():
                return

    def read(
        self, pool: Any, page_id: int, wait: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Page `page_id`'s state [1, hidden] (zeros where inactive); the same on every rank.
        `wait(layer)` first, for each state layer (a pending host -> device load carries them)."""
        if not self.active:
            return torch.zeros(1, self.hidden_size)
        for i in range(self.first, self.first + self.layers):
            if wait is not None:
                wait(i)
        h = torch.zeros(1, self.hidden_size, dtype=pool.k(self.first).dtype)
        if _owns(pool, page_id):
            flat = torch.cat(self._slots(pool, _local(pool, page_id)))[: self.hidden_size]
            h = flat.reshape(1, -1).clone()
        if self.group is not None:
            dist.all_reduce(h, group=self.group)  # exact: one owner, zeros elsewhere
        return h


def _owns(pool: Any, page_id: int) -> bool:
    return getattr(pool, "n_shards", 1) == 1 or pool.owns(page_id)


def _local(pool: Any, page_id: int) -> int:
    return page_id if getattr(pool, "n_shards", 1) == 1 else pool.local_slot(page_id)

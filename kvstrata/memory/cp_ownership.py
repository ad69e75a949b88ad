"""Which context-parallel rank holds a page: a fixed rule on the logical page id, no lookup table.

The device pool of rank r (DevicePool(n_shards=cp, rank=r)) holds only the pages it owns; the
per-layer gather (kvstrata.model_parallel.cp_gather) and each rank's mover share
(kvstrata.memory.transfer.RankShare) read the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CPOwnership:
    """owner = id % cp, slot = id // cp: which rank holds a page's KV, and where."""

    cp: int

    def __post_init__(self) -> None:
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"cp must be an integer >= 1, got {self.cp!r}")

    def owner(self, page_id: int) -> int:
        return page_id % self.cp

    def slot(self, page_id: int) -> int:
        return page_id // self.cp

    def page_id(self, owner: int, slot: int) -> int:
        return slot * self.cp + owner

    def owned(self, page_ids: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        """(positions in page_ids, local slots) of the pages `rank` owns, in logical order.
        A restore from host/storage writes exactly these pages on `rank` before the gather."""
        pos = [i for i, p in enumerate(page_ids) if p % self.cp == rank]
        return pos, [page_ids[i] // self.cp for i in pos]

    def shares(self, page_ids: Sequence[int]) -> list[int]:
        """How many of `page_ids` each rank owns (balanced when ids come round robin)."""
        counts = [0] * self.cp
        for p in page_ids:
            counts[p % self.cp] += 1
        return counts

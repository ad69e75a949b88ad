"""Deterministic page allocator with context-parallel ownership derived from the page id.

Logical page id -> owner = id % n_shards, slot = id // n_shards. There is no lookup table: every
rank runs the same allocator with the same calls and gets the same ids. alloc() hands ids out
round robin over shards (a cursor that persists across calls), so a sequence's pages are balanced
over owners even when it grows one page at a time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class PageAllocator:
    """Free lists (one FIFO per shard) over `capacity` logical page ids."""

    def __init__(self, capacity: int, n_shards: int = 1) -> None:
        if isinstance(n_shards, bool) or not isinstance(n_shards, int) or n_shards <= 0:
            raise ValueError(f"n_shards must be a positive int, got {n_shards!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if capacity % n_shards:
            raise ValueError(f"capacity ({capacity}) must be a multiple of n_shards ({n_shards})")
        self.capacity = capacity
        self.n_shards = n_shards
        self.capacity_local = capacity // n_shards
        # shard s holds free *slots*; id = slot * n_shards + s
        self._free: list[deque[int]] = [deque(range(self.capacity_local)) for _ in range(n_shards)]
        self._is_free = bytearray(b"\x01") * capacity  # by id
        self._num_free = capacity
        self._cursor = 0  # next shard to hand an id from

    def owner(self, page_id: int) -> int:
        return page_id % self.n_shards

    def slot(self, page_id: int) -> int:
        return page_id // self.n_shards

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.capacity - self._num_free

    def num_free_in(self, shard: int) -> int:
        return len(self._free[shard])

    def alloc(self, n: int) -> list[int] | None:
        """n ids, round robin over shards; None (and no change) if fewer than n are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"alloc: n must be an int >= 0, got {n!r}")
        if n > self._num_free:
            return None
        k = self.n_shards
        if k == 1:
            q = self._free[0]
            out = [q.popleft() for _ in range(n)]
        else:
            out = []
            s = self._cursor
            while len(out) < n:  # an empty shard is skipped: at most k steps per id
                q = self._free[s]
                if q:
                    out.append(q.popleft() * k + s)
                s = (s + 1) % k
            self._cursor = s
        for i in out:
            self._is_free[i] = 0
        self._num_free -= n
        return out

    def alloc_owners(self, owners: list[int]) -> list[int] | None:
        """One id per entry, owned by that shard (owner = id % n_shards), in order; None (and
        no change) if some shard has too few free. Used to give a page the same owner in device
        memory and host under context parallel, so its bytes never leave the owner rank."""
        need = [0] * self.n_shards
        for s in owners:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.n_shards:
                raise ValueError(f"alloc_owners: owner must be in [0, {self.n_shards}), got {s!r}")
            need[s] += 1
        if any(n > len(q) for n, q in zip(need, self._free, strict=True)):
            return None
        k = self.n_shards
        out = [self._free[s].popleft() * k + s for s in owners]
        for i in out:
            self._is_free[i] = 0
        self._num_free -= len(out)
        return out

    def free(self, ids: Iterable[int]) -> None:
        """Return ids to their shard's free list. All or nothing: bad input changes nothing."""
        ids = list(ids)
        seen: set[int] = set()
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise ValueError(f"free: page id must be an int, got {i!r}")
            if not 0 <= i < self.capacity:
                raise ValueError(f"free: page id {i} is outside [0, {self.capacity})")
            if self._is_free[i] or i in seen:
                raise ValueError(f"free: page id {i} is not allocated (double free?)")
            seen.add(i)
        k = self.n_shards
        for i in ids:
            self._is_free[i] = 1
            self._free[i % k].append(i // k)
        self._num_free += len(ids)

    def is_free(self, page_id: int) -> bool:
        return bool(self._is_free[page_id])

    def check_integrity(self) -> None:
        """free lists, free flags and the free count agree; no id is listed twice."""
        k = self.n_shards
        listed = [slot * k + s for s, q in enumerate(self._free) for slot in q]
        assert len(listed) == self._num_free, (len(listed), self._num_free)
        assert len(set(listed)) == len(listed), "an id is on a free list twice"
        assert all(0 <= i < self.capacity for i in listed), "free id out of range"
        assert all(self._is_free[i] for i in listed), "listed id not flagged free"
        assert sum(self._is_free) == self._num_free, "free flags disagree with the free count"
        assert 0 <= self._cursor < k

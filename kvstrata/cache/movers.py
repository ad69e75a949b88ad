"""A tensor-free PageMover: moves no bytes, tracks which keys storage holds.

Used where only the cache's decisions matter: full-scale trace replay, the what-if simulator
(which charges time per moved page from a hardware profile), and property tests of the
manager. `delay` makes an op finish only after that many polls (seeded per rank to test late
completions); `fail_storage` makes storage reads and writes fail, as an unreachable backend would.
"""

from __future__ import annotations

import random

from kvstrata.cache.ops import BACKUP, PREFETCH, PROBE, TransferOp


class KeySetMover:
    """Completes ops after a (possibly random) number of polls; storage is a set of keys."""

    def __init__(self, max_delay: int = 0, seed: int = 0, storage_capacity: int = 0) -> None:
        self.stored: dict[int, None] = {}  # insertion-ordered set of keys in storage
        self.storage_capacity = storage_capacity  # pages; 0 = unbounded (oldest dropped first)
        self.max_delay = max_delay
        self.rng = random.Random(seed)
        self.fail_storage = False
        self._remaining: dict[int, int] = {}
        self._result: dict[int, int] = {}

    def submit(self, op: TransferOp) -> None:
        self._remaining[id(op)] = self.rng.randint(0, self.max_delay) if self.max_delay else 0

    def cancel(self, op: TransferOp) -> None:
        op.cancelled = True

    def wait_answered(self, op: TransferOp, timeout_s: float) -> None:
        """Ops finish as they are polled here: nothing to wait for."""

    def poll(self, op: TransferOp) -> int | None:
        key = id(op)
        if key in self._result:
            return self._result[key]
        if self._remaining.get(key, 0) > 0 and not op.cancelled:
            self._remaining[key] -= 1
            return None
        self._remaining.pop(key, None)
        self._result[key] = res = self._finish(op)
        return res

    def release(self, op: TransferOp) -> None:
        self._result.pop(id(op), None)

    def _finish(self, op: TransferOp) -> int:
        if op.kind in (PROBE, PREFETCH):
            return 0 if self.fail_storage else self._leading(op.keys)
        if op.kind == BACKUP:
            if self.fail_storage:
                return 0
            for k in op.keys:
                self.stored[k] = None
            self._trim()
            return op.pages
        return op.pages

    def _leading(self, keys: list[int]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.stored:
            n += 1
        return n

    def _trim(self) -> None:
        while self.storage_capacity and len(self.stored) > self.storage_capacity:
            del self.stored[next(iter(self.stored))]

"""Eviction candidates per tier: a heap with lazy invalidation.

Candidates are pushed when they may have become evictable (a child left the tier, a node entered
it); stale entries (the node left the tier, its priority changed, a child re-entered) are checked
and dropped or re-pushed at pop time, so no eviction scans the whole tree. Priorities (LRU, LFU)
only grow, so a stale entry is never popped too late.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvstrata.cache.policies import Priority
from kvstrata.cache.radix import Node


def _evictable(node: Node) -> bool:
    return node.evictable


class TierQueue:
    """Leaf-first eviction order of one tier under one priority."""

    def __init__(self, is_candidate: Callable[[Node], bool], priority: Priority) -> None:
        self.is_candidate = is_candidate
        self.priority = priority
        self._heap: list[tuple[tuple[int, ...], int, Node]] = []
        self._seq = 0  # FIFO tie-break: deterministic across ranks
        self._compacted_size = 0

    def push(self, node: Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.priority(node), self._seq, node))

    def pop(self, may_take: Callable[[Node], bool] = _evictable) -> Node | None:
        """The candidate of lowest priority that `may_take` allows (default: not busy, not
        pinned), or None. The others are set aside."""
        busy: list[Node] = []
        found = None
        while self._heap:
            prio, _, node = heapq.heappop(self._heap)
            if node.parent is None or not self.is_candidate(node):
                continue  # left the tree or the tier, or has a resident child: stale
            if prio != self.priority(node):
                self.push(node)
                continue
            if not may_take(node):
                busy.append(node)
                continue
            found = node
            break
        for node in busy:
            self.push(node)
        return found

    def compact(self) -> None:
        """Drop stale and duplicate entries once the heap has grown 4x since the last time."""
        if len(self._heap) <= 4 * self._compacted_size + 1024:
            return
        entries = sorted(self._heap, key=lambda e: e[1])  # keep first-push order: deterministic
        nodes = {id(n): n for _, _, n in entries if n.parent is not None and self.is_candidate(n)}
        self._heap = []
        for node in nodes.values():
            self.push(node)
        self._compacted_size = len(self._heap)

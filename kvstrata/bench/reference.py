"""Independent, naive references the replay is checked against (no radix tree, no tiers).

- `ceiling`: an infinite-capacity page cache: a set of every page key seen so far.
- `NaiveLRU`: a one-tier LRU over a flat dict of pages, written without the radix tree. It
  reproduces the manager's observable rules, which a page-level LRU would not: the victim is the
  least recently used leaf *run* of pages (a tree node), of which only the pages still needed go,
  from its tail; runs are cut exactly where the tree splits its edges (at the end of a match and
  where an insert diverges). Every scan is linear; it is meant for small traces.
- `BlockLRU`: vLLM's block pool (free queue, tail-first release) for non-branching workloads.

Both use the replay's hit rule: a request can hit only full pages inside its first
input_length - 1 tokens (the last prompt token is always computed, to produce logits).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def hittable_pages(input_length: int, page_size: int) -> int:
    """Full pages a request may take from the cache (its last token is always computed)."""
    return (input_length - 1) // page_size


def ceiling(requests: Iterable[tuple[list[int], list[int]]]) -> list[int]:
    """Hit pages per request with unbounded capacity.

    Each item is (keys the request may hit, keys it leaves cached); hits are the longest prefix
    of the first list seen before.
    """
    seen: set[int] = set()
    hits: list[int] = []
    for match_keys, insert_keys in requests:
        n = 0
        for k in match_keys:
            if k not in seen:
                break
            n += 1
        hits.append(n)
        seen.update(insert_keys)
    return hits


@dataclass
class _Page:
    parent: int | None  # key of the previous page in the chain (None: first page)
    run: int  # id of the run (tree node) holding this page
    last: int  # logical clock of the last match/insert that touched the run


class NaiveLRU:
    """Single-tier LRU over `capacity` pages with run-granular, leaf-first eviction."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.pages: dict[int, _Page] = {}
        self.clock = 0
        self._next_run = 0

    def _new_run(self) -> int:
        self._next_run += 1
        return self._next_run

    def _cut_before(self, keys: list[int], n: int) -> None:
        """Cut the run of keys[n - 1] after it when the run continues (the tree splits its edge)."""
        if n == 0:
            return
        run = self.pages[keys[n - 1]].run
        if any(p.parent == keys[n - 1] and p.run == run for p in self.pages.values()):
            upper = self._new_run()
            for k in keys[:n]:
                if self.pages[k].run == run:
                    self.pages[k].run = upper

    def _prefix(self, keys: list[int]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def _touch(self, keys: list[int]) -> None:
        """Stamp every page of every run on the path (the tree stamps whole nodes)."""
        runs = {self.pages[k].run for k in keys}
        for p in self.pages.values():
            if p.run in runs:
                p.last = self.clock

    def match(self, keys: list[int]) -> int:
        """Cached prefix length of `keys` in pages; touches the matched runs."""
        self.clock += 1
        n = self._prefix(keys)
        self._cut_before(keys, n)
        self._touch(keys[:n])
        return n

    def evict(self, n: int, locked_keys: list[int]) -> None:
        """Evict whole least-recently-used leaf runs until n pages are free (or none is left)."""
        locked = {self.pages[k].run for k in locked_keys}
        while self.capacity - len(self.pages) < n:
            inner = _runs_with_child(self.pages)
            leaves = {p.run: p.last for p in self.pages.values() if p.run not in inner | locked}
            if not leaves:
                return
            victim = min(leaves, key=lambda r: (leaves[r], r))
            run = [k for k, p in self.pages.items() if p.run == victim]  # in chain order
            short = n - (self.capacity - len(self.pages))
            for k in run[-short:]:  # only the pages still needed, from the run's tail
                del self.pages[k]

    def insert(self, keys: list[int], matched: int) -> bool:
        """Cache `keys`, whose first `matched` pages the request matched (and locked).

        Pages for everything after the match are allocated first, all or nothing, evicting with
        the matched prefix locked (like the replay's alloc_device); False if they do not fit.
        """
        need = len(keys) - matched
        if need > 0:
            self.evict(need, keys[:matched])
            if self.capacity - len(self.pages) < need:
                return False
        if not keys:
            return True
        self.clock += 1
        p = self._prefix(keys)
        self._cut_before(keys, p)
        self._touch(keys[:p])
        run = self._new_run()
        for i in range(p, len(keys)):
            self.pages[keys[i]] = _Page(keys[i - 1] if i else None, run, self.clock)
        return True


def _runs_with_child(pages: dict[int, _Page]) -> set[int]:
    """Runs that some page of another run hangs below."""
    out: set[int] = set()
    for p in pages.values():
        if p.parent is not None:
            parent_run = pages[p.parent].run
            if parent_run != p.run:
                out.add(parent_run)
    return out


class BlockLRU:
    """vLLM's prefix-cache block pool, written plainly: a request locks the cached blocks of
    its prefix, takes new blocks from the head of a free queue (evicting the cached block there),
    and when it finishes returns its blocks tail first to the end of the queue. So the least
    recently finished request loses its last blocks first and keeps its prefix longest."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.free: dict[int, None] = {}  # cached, unused blocks by key; first = evicted first
        self.blank = capacity  # blocks holding nothing

    def serve(self, match_keys: list[int], insert_keys: list[int]) -> int:
        """One request: hit blocks of `match_keys`, then cache `insert_keys`; returns the hits
        (0 when its blocks do not fit, as the cache serves such a request uncached)."""
        hit = 0
        while hit < len(match_keys) and match_keys[hit] in self.free:
            hit += 1
        need = len(insert_keys) - hit
        if need > self.blank + len(self.free) - hit:
            return 0
        held = insert_keys[:hit]
        for k in held:
            del self.free[k]
        for k in insert_keys[hit:]:
            self.free.pop(k, None)  # a later duplicate of a cached block replaces it
            if self.blank:
                self.blank -= 1
            else:
                del self.free[next(iter(self.free))]
            held.append(k)
        for k in reversed(held):
            self.free[k] = None
        return hit

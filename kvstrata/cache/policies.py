"""Pluggable cache policies, each chosen by name through a registry.

- eviction: a priority per node; the lowest is evicted first (leaf first).
- write: when a page on device memory gets its host copy.
- prefetch: when a waiting request stops waiting for its storage -> host prefetch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.cache.radix import Node
from kvstrata.registry import Registry

Priority = Callable[[Node], tuple[int, ...]]
EVICTION: Registry[Priority] = Registry("eviction policy")


@EVICTION.register("lru")
def lru_priority() -> Priority:
    """Least recently used first."""
    return lambda node: (node.last_access,)


@EVICTION.register("lfu")
def lfu_priority() -> Priority:
    """Least frequently used first, ties by recency."""
    return lambda node: (node.hits, node.last_access)


@dataclass(frozen=True)
class WritePolicy:
    """When device pages are copied to host memory (host -> storage backup always follows a host
    copy, asynchronously)."""

    on_insert: bool
    """Back a page up as soon as it is inserted."""
    hit_threshold: int
    """Back a page up once its node was hit this many times (0 = never for this reason)."""
    on_evict: bool
    """Demote to host memory on device eviction instead of dropping the page."""


WRITE: Registry[WritePolicy] = Registry("write policy")


@WRITE.register("write_through")
def write_through(threshold: int) -> WritePolicy:
    return WritePolicy(on_insert=True, hit_threshold=0, on_evict=True)


@WRITE.register("write_through_selective")
def write_through_selective(threshold: int) -> WritePolicy:
    return WritePolicy(on_insert=False, hit_threshold=threshold, on_evict=False)


@WRITE.register("write_back")
def write_back(threshold: int) -> WritePolicy:
    return WritePolicy(on_insert=False, hit_threshold=0, on_evict=True)


@dataclass(frozen=True)
class PrefetchState:
    """What a prefetch policy sees: all of it agreed across ranks (no local clocks)."""

    pages: int
    """Pages asked from storage."""
    waited_s: float
    """Agreed time since the prefetch started (the scheduler's step clock)."""
    can_schedule: bool
    """The request would fit in device memory now."""


StopRule = Callable[[PrefetchState], bool]
PREFETCH: Registry[StopRule] = Registry("prefetch policy")


@PREFETCH.register("best_effort")
def best_effort(base_s: float, per_page_s: float) -> StopRule:
    """Stop as soon as the request can be scheduled: use what arrived by then."""
    return lambda s: s.can_schedule


@PREFETCH.register("wait_complete")
def wait_complete(base_s: float, per_page_s: float) -> StopRule:
    """Never stop early: the request waits for the whole prefetch."""
    return lambda s: False


@PREFETCH.register("timeout")
def timeout(base_s: float, per_page_s: float) -> StopRule:
    """Stop when the budget, growing with the prefix length, is spent."""
    return lambda s: s.waited_s >= base_s + per_page_s * s.pages

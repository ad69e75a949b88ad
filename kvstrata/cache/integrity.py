"""Accounting and integrity of a HiCache: every page id of each pool used exactly once.

free + cached + locked + in flight = capacity, per pool; tests call `check` after every step
and after each fault.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.cache.ops import LOAD, PREFETCH, STORE
from kvstrata.cache.tiers import Allocator

if TYPE_CHECKING:
    from kvstrata.cache.hicache import HiCache


def accounting(cache: HiCache) -> dict[str, dict[str, int]]:
    """free + cached + locked + in flight = capacity, per pool."""
    dev = {
        "free": cache.tiers.device.num_free,
        "cached": 0,
        "locked": len(cache.owned),
        "in_flight": 0,
    }
    host = {
        "free": cache.tiers.host.num_free if cache.tiers.host else 0,
        "cached": 0,
        "locked": 0,
        "in_flight": len(cache.queues.inflight_ids(STORE, "dst"))
        + len(cache.queues.inflight_ids(PREFETCH, "dst")),
    }
    loading = set(cache.queues.inflight_ids(LOAD, "dst"))
    for node in cache.tree.nodes():
        busy = "locked" if node.busy else "cached"  # pinned by a client: still cached
        if node.device is not None:
            moving = sum(1 for d in node.device if d in loading)
            dev["in_flight"] += moving
            dev[busy] += len(node) - moving
        if node.host is not None:
            host[busy] += len(node)
    return {"device": dev, "host": host}


def check(cache: HiCache) -> None:
    """Tree invariants, and every page id accounted for exactly once in each pool."""
    cache.tree.check_integrity()
    used_dev = [d for n in cache.tree.nodes() if n.device is not None for d in n.device]
    used_dev += list(cache.owned)
    _check_pool("device", used_dev, cache.tiers.device)
    if cache.tiers.host is not None:
        used_host = [h for n in cache.tree.nodes() if n.host is not None for h in n.host]
        used_host += cache.queues.inflight_ids(STORE, "dst") + cache.queues.inflight_ids(
            PREFETCH, "dst"
        )
        _check_pool("host", used_host, cache.tiers.host)
    for pool, parts in accounting(cache).items():
        cap = (
            cache.tiers.device.capacity
            if pool == "device"
            else (cache.tiers.host.capacity if cache.tiers.host else 0)
        )
        assert sum(parts.values()) == cap, f"{pool}: {parts} does not add up to {cap}"


def _check_pool(name: str, used: list[int], alloc: Allocator) -> None:
    assert len(used) == len(set(used)), f"{name}: a page id is used twice"
    assert all(0 <= i < alloc.capacity for i in used), f"{name}: page id out of range"
    assert len(used) + alloc.num_free == alloc.capacity, (
        f"{name}: {len(used)} used + {alloc.num_free} free != {alloc.capacity}"
    )
    check = getattr(alloc, "check_integrity", None)
    if check is not None:
        check()

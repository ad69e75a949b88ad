"""Tier residency of tree nodes: allocation with eviction cascading device -> host -> (storage
/ gone).

Tensor-free: page ids come from allocators, bytes move through the manager's ops. Every rank
runs the same calls in the same order, so evictions pick the same nodes everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvstrata.cache.counters import CacheCounters
from kvstrata.cache.eviction import TierQueue
from kvstrata.cache.pins import PinBook
from kvstrata.cache.policies import Priority, WritePolicy
from kvstrata.cache.radix import Node, RadixTree


class Allocator(Protocol):
    capacity: int

    @property
    def num_free(self) -> int: ...

    def alloc(self, n: int) -> list[int] | None: ...

    def alloc_owners(self, owners: list[int]) -> list[int] | None: ...

    def num_free_in(self, shard: int) -> int: ...

    def free(self, ids: list[int]) -> None: ...


def _device_candidate(node: Node) -> bool:
    return node.device is not None and not node.has_device_child()


def _host_candidate(node: Node) -> bool:
    return node.host is not None and (node.device is not None or not node.children)


def _host_may_take(node: Node) -> bool:
    """A host copy may go unless a copy reads or writes it, a client pin keeps it, or a
    request holds it and it is the node's only copy outside the device or storage. A request
    reads a node with a device copy from the device, so that node's host copy may go once
    storage holds its pages: host memory full of running requests' pages then still takes
    the next prompt's pages and reloads (the insert walk does not copy it back while held)."""
    if node.pins or node.keep:
        return False
    return not node.lock_ref or host_copy_spared(node)


def host_copy_spared(node: Node) -> bool:
    """A held node whose host copy may go (or stay gone): the device and storage hold it."""
    return node.lock_ref > 0 and node.device is not None and node.in_storage


class Tiers:
    """Device and host residency with leaf-first eviction under one priority.

    Sharded allocators (context parallel, n_shards > 1: owner = id % n_shards) must have the
    same n_shards in both tiers: a page's host id gets the owner of its device id and back
    (`like=`), so its bytes stay on one rank; pages coming from storage take any owner.
    """

    def __init__(
        self,
        tree: RadixTree,
        device: Allocator,
        host: Allocator | None,
        priority: Priority,
        write: WritePolicy,
        counters: CacheCounters,
        demote: Callable[[Node, list[int]], None],
    ) -> None:
        self.tree, self.device, self.host = tree, device, host
        self.shards = getattr(device, "n_shards", 1)
        if host is not None and getattr(host, "n_shards", 1) != self.shards:
            raise ValueError(
                f"host allocator has {getattr(host, 'n_shards', 1)} shards, device {self.shards}"
            )
        self.write, self.counters = write, counters
        self.demote = demote  # submits the device -> host copy of a node being evicted
        self.device_q = TierQueue(_device_candidate, priority)
        self.host_q = TierQueue(_host_candidate, priority)
        self.freeing = 0  # device pages whose demotion copy is in flight
        self.pins: PinBook | None = None  # client pins (the manager's), read by eviction
        self._requeued_at: tuple[int, int] = (-1, -1)

    def touched(self, node: Node | None) -> None:
        """`node` may have become a candidate in some tier."""
        if node is None or node is self.tree.root:
            return
        if node.device is not None:
            self.device_q.push(node)
        if node.host is not None:
            self.host_q.push(node)

    # ---- device -------------------------------------------------------------------------------
    def alloc_device(
        self, n: int, like: list[int] | None = None, spare_pinned: bool = False
    ) -> list[int] | None:
        """n device pages, evicting cached pages if needed; None if they cannot be had now.

        like: ids (host ids) whose owners the new ids must have, position by position.
        spare_pinned: take no pinned page's device copy (a prefetch hint's load)."""
        if n == 0:
            return []
        evict = self.evict_device if not spare_pinned else self._evict_unpinned
        if like is not None and self.shards > 1:
            assert len(like) == n
            return self._alloc_like(self.device, like, evict)
        if self.device.num_free < n:
            evict(n - self.device.num_free)
        if self.device.num_free + self.freeing < n:
            self.requeue_all()  # a candidate the lazy queues missed (e.g. a split edge)
            evict(n - self.device.num_free - self.freeing)
        return self.device.alloc(n) if self.device.num_free >= n else None

    def evict_device(self, n: int) -> None:
        """Free at least n device pages (some only once their demotion copy lands): unpinned
        pages first (and, in the same LRU order, pinned ones with a host copy while the pinned
        pages hold more than their device share, `pin_device_share`); then any pinned page: a
        pin never keeps a request out (its page is demoted to the host tier, which keeps it, or
        at worst dropped with its pin)."""
        goal_free = self.device.num_free + n  # pages already being freed count toward it
        self._evict_device_pass(goal_free, self._pinned_device_over())
        if self.pins is not None and self.pins.pins:
            self._evict_device_pass(goal_free, True, host_copy_only=False)

    def _evict_unpinned(self, n: int) -> None:
        self._evict_device_pass(self.device.num_free + n, take_kept=False)

    def _pinned_device_over(self) -> bool:
        """Pinned pages hold more of the device than their share: those with a host copy may go
        in LRU order with the others."""
        return self.pins is not None and self.pins.device_over()

    def _evict_device_pass(
        self, goal_free: int, take_kept: bool, host_copy_only: bool = True
    ) -> None:
        def may_take(node: Node) -> bool:
            if node.busy:
                return False
            return not node.keep or (take_kept and (node.host is not None or not host_copy_only))

        skipped: list[Node] = []
        while (need := goal_free - self.device.num_free - self.freeing) > 0:
            node = self.device_q.pop(may_take)
            if node is None:
                break
            if not self.evict_node(self._tail(node, need)):
                skipped.append(node)
        for node in skipped:
            self.device_q.push(node)

    def _tail(self, node: Node, need: int) -> Node:
        """The last `need` pages of a leaf candidate as a node of their own (a split), so an
        eviction takes only the pages it needs and the rest of the run stays cached. A node
        with children (host-only pages below it) goes whole: they depend on its pages."""
        if len(node) <= need or node.children:
            return node
        upper = self.tree.split(node, len(node) - need)
        self.touched(upper)
        return node

    def evict_node(self, node: Node) -> bool:
        """Evict one node's device copy under the write policy: drop it where a host copy
        exists, demote it (device -> host copy, dropped once landed) when the policy copies on
        eviction, else drop it with its host-only descendants. False: a descendant is busy."""
        assert node.device is not None
        if node.host is not None:
            self.drop_device(node)
            return True
        if self.write.on_evict and self.host is not None:
            host_ids = self.alloc_host(len(node), like=node.device)
            if host_ids is not None:
                node.pins += 1  # until the copy lands; then the device copy goes
                self.freeing += len(node)
                self.demote(node, host_ids)
                return True
        return self._drop_subtree(node)

    def drop_device(self, node: Node) -> None:
        """Release a node's device copy (it keeps its host copy if any)."""
        assert node.device is not None
        self.device.free(node.device)
        self.counters.evictions["device"] += len(node)
        node.device = None
        parent = node.parent
        if node.host is None:
            self._count_lost(node)
            if node.keep and self.pins is not None:  # its only copy goes: so do its pins
                self.pins.lose(node)
            self.tree.remove_leaf(node)
        else:
            self.host_q.push(node)
        self.touched(parent)  # type: ignore[arg-type]

    def _drop_subtree(self, node: Node) -> bool:
        """Drop a node without a host copy, with its host-only descendants; False if one is busy."""
        below = [n for n in _subtree(node) if n is not node]
        if any(not n.evictable for n in below):
            return False
        for child in reversed(below):  # leaves first
            self._drop_host_only(child)
        self.drop_device(node)
        return True

    def _count_lost(self, node: Node) -> None:
        """The node's last cached copy goes now: its pages are lost unless storage has them."""
        if not node.in_storage:
            self.counters.lost_pages += len(node)

    # ---- host ---------------------------------------------------------------------------------
    def alloc_host(self, n: int, like: list[int] | None = None) -> list[int] | None:
        """n host pages (like: device ids whose owners they must have), evicting if needed."""
        if self.host is None:
            return None
        if like is not None and self.shards > 1:
            assert len(like) == n
            return self._alloc_like(self.host, like, self.evict_host)
        if self.host.num_free < n:
            self.evict_host(n - self.host.num_free)
        if self.host.num_free < n:
            self.requeue_all()
            self.evict_host(n - self.host.num_free)
        return self.host.alloc(n) if self.host.num_free >= n else None

    def alloc_host_upto(self, n: int) -> list[int]:
        """Up to n host pages (any owner), as many as eviction can make room for."""
        if self.host is None:
            return []
        got = self.alloc_host(n)
        if got is not None:
            return got
        return self.host.alloc(min(n, self.host.num_free)) or []

    def evict_host(self, n: int) -> None:
        assert self.host is not None
        goal_free = self.host.num_free + n
        while (need := goal_free - self.host.num_free) > 0:
            node = self.host_q.pop(_host_may_take)
            if node is None:
                break
            node = self._tail(node, need)
            if node.device is not None:
                self.host.free(node.host)  # type: ignore[arg-type]
                self.counters.evictions["host"] += len(node)
                node.host = None
            else:
                self._drop_host_only(node)

    def _drop_host_only(self, node: Node) -> None:
        assert node.device is None and node.host is not None and not node.children
        assert self.host is not None
        self.host.free(node.host)
        self.counters.evictions["host"] += len(node)
        self._count_lost(node)
        node.host = None
        parent = node.parent
        self.tree.remove_leaf(node)
        self.touched(parent)  # type: ignore[arg-type]

    def _alloc_like(
        self, alloc: Allocator, like: list[int], evict: Callable[[int], None]
    ) -> list[int] | None:
        """Ids with the owners of `like`: evict (any shard, by priority) until each owner has
        room, at most one extra pass after a full requeue. Same calls on every rank."""
        owners = [i % self.shards for i in like]
        need = [owners.count(s) for s in range(self.shards)]

        def short() -> int:
            return sum(max(0, n - alloc.num_free_in(s)) for s, n in enumerate(need))

        for attempt in range(2):
            if attempt:
                self.requeue_all()
            prev = -1
            while (gap := short()) and gap != prev:  # stop once a pass frees nothing useful
                prev = gap
                evict(gap)
        return alloc.alloc_owners(owners)

    def requeue_all(self) -> None:
        """Push every node again: O(nodes), only when the lazy queues ran dry."""
        if self._requeued_at == (self.tree.clock, self.device.num_free):
            return  # nothing changed since the last full requeue
        self._requeued_at = (self.tree.clock, self.device.num_free)
        for node in self.tree.nodes():
            self.touched(node)

    def compact(self) -> None:
        self.device_q.compact()
        self.host_q.compact()

    # ---- reset --------------------------------------------------------------------------------
    def clear_device(self, drop_host: bool) -> None:
        """Drop every cached device copy (a prefix-cache reset); with drop_host every host copy too.

        The caller checked that nothing is locked, pinned (copies or clients) or in flight. A node keeps its place
        only with a host copy kept and a parent that stays (a match walks from the root); the
        eviction queues' entries for dropped nodes go stale and are skipped when popped.
        """
        assert self.freeing == 0, "clear_device with a demotion in flight"
        stay: set[Node] = set()
        for node in self.tree.nodes():  # parents before children
            assert node.evictable, "clear_device with a locked or pinned node"
            up = node.parent
            if node.host is not None and not drop_host and (up is self.tree.root or up in stay):
                stay.add(node)
        for node in reversed(list(self.tree.nodes())):  # children before parents
            if node.device is not None:
                self.device.free(node.device)
                node.device = None
            if node in stay:
                self.host_q.push(node)  # may have become a host candidate (no device copy now)
                continue
            if node.host is not None:
                assert self.host is not None
                self.host.free(node.host)
                node.host = None
            self.tree.remove_leaf(node)


def _subtree(node: Node) -> list[Node]:
    """`node` and its descendants, parents before children."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out

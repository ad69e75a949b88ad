"""Paged radix tree over chained page keys (tensor-free).

Each edge holds a run of page keys and, per tier, where those pages live: `device` (L1 logical page
ids), `host` (L2 host page ids) and `in_storage` (written to L3). Tier invariants:
- every node except the root is on the device, on the host, or both;
- the device-resident nodes are closed under ancestors (eviction from L1 is leaf-first), so a
  match is an L1 prefix followed by host-only pages;
- a node with `lock_ref > 0` (a running request uses it) or `pins > 0` (a copy reads it) is never
  evicted from any tier.
Time is a logical clock (one tick per match/insert), identical on every rank, never wall time.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import compress
from operator import ne


class Node:
    """One edge of the tree: a run of pages sharing the same tier state."""

    __slots__ = (
        "parent",
        "children",
        "keys",
        "device",
        "host",
        "in_storage",
        "lock_ref",
        "pins",
        "hits",
        "last_access",
    )

    def __init__(
        self,
        parent: Node | None,
        keys: list[int],
        device: list[int] | None,
        host: list[int] | None = None,
        clock: int = 0,
    ) -> None:
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.keys = keys
        self.device = device
        self.host = host
        self.in_storage = False
        self.lock_ref = 0
        self.pins = 0
        self.hits = 0
        self.last_access = clock

    def __len__(self) -> int:
        return len(self.keys)

    def __lt__(self, other: Node) -> bool:  # heap tie-break: deterministic by first key
        return self.keys[0] < other.keys[0]

    @property
    def evictable(self) -> bool:
        return self.lock_ref == 0 and self.pins == 0

    def has_device_child(self) -> bool:
        return any(c.device is not None for c in self.children.values())


class Match:
    """The longest cached prefix of a key chain, split by tier (a plain slotted class: one is
    made per lookup, on the admission path).

    - device_ids: L1 page ids of the leading pages resident on the device;
    - host_nodes: nodes after the L1 prefix whose pages are only in host memory (L2), in order;
    - device_node: deepest matched node that is on the device (root if none);
    - last_node: deepest matched node (the end of the L1 + L2 prefix).
    """

    __slots__ = ("device_ids", "host_nodes", "device_node", "last_node")

    def __init__(
        self,
        device_ids: list[int] | None = None,
        host_nodes: list[Node] | None = None,
        device_node: Node | None = None,
        last_node: Node | None = None,
    ) -> None:
        self.device_ids: list[int] = [] if device_ids is None else device_ids
        self.host_nodes: list[Node] = [] if host_nodes is None else host_nodes
        self.device_node = device_node
        self.last_node = last_node

    @property
    def device_pages(self) -> int:
        return len(self.device_ids)

    @property
    def host_pages(self) -> int:
        return sum(len(n) for n in self.host_nodes)

    @property
    def pages(self) -> int:
        return self.device_pages + self.host_pages


class RadixTree:
    """Prefix tree keyed by page keys; the cache manager owns tier moves and accounting."""

    def __init__(self) -> None:
        self.root = Node(None, [], device=[], host=[])
        self.clock = 0

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, keys: list[int], touch: bool = True) -> Match:
        """Longest cached prefix of `keys`; splits a partially matched edge at the match end.

        Hot path (every admission): one dict lookup and one C-level list comparison per node,
        no per-key Python work unless the match ends inside an edge.
        """
        self.clock += 1
        clock = self.clock
        device_ids: list[int] = []
        host_nodes: list[Node] = []
        node = device_node = self.root
        i, total = 0, len(keys)
        while i < total:
            child = node.children.get(keys[i])
            if child is None:
                break
            edge = child.keys
            end = i + len(edge)
            # the request ends or turns inside this edge (a one-page edge matched by the lookup)
            partial = end - i > 1 and keys[i:end] != edge
            if partial:
                n = _common_len(edge, keys, i)
                child = self.split(child, n)
                end = i + n
            if touch:
                child.last_access = clock
                child.hits += 1
            if child.device is not None:
                device_ids += child.device
                device_node = child
            else:
                host_nodes.append(child)
            node, i = child, end
            if partial:
                break  # the split-off lower part starts with a key that differs (or none left)
        return Match(device_ids, host_nodes, device_node, node)

    def split(self, node: Node, n: int) -> Node:
        """Cut `node` after its first n pages; returns the new upper node (which keeps the stats)."""
        assert 0 < n < len(node), "split point must be inside the edge"
        upper = Node(
            node.parent, node.keys[:n], _head(node.device, n), _head(node.host, n), node.last_access
        )
        upper.in_storage, upper.lock_ref, upper.pins, upper.hits = (
            node.in_storage,
            node.lock_ref,
            node.pins,
            node.hits,
        )
        assert node.parent is not None
        node.parent.children[upper.keys[0]] = upper
        node.keys, node.device, node.host = (
            node.keys[n:],
            _tail(node.device, n),
            _tail(node.host, n),
        )
        node.parent = upper
        upper.children[node.keys[0]] = node
        return upper

    # ---- update -------------------------------------------------------------------------------
    def insert(self, keys: list[int], device_ids: list[int]) -> tuple[Node, list[int]]:
        """Cache `keys` with their L1 pages. Returns (last node, ids the caller must free).

        Pages already on the device keep their existing ids (the caller's duplicates come back
        to be freed); matched nodes that had left the device adopt the caller's ids. The tree
        keeps its own copies of the id lists (slices), never the caller's list.
        """
        assert len(keys) == len(device_ids), "one device page per key"
        ids = device_ids if type(device_ids) is list else list(device_ids)
        self.clock += 1
        clock = self.clock
        node, i, total = self.root, 0, len(keys)
        held: list[int] = []  # the tree's ids of keys[:i] (after adoption), compared at the end
        while i < total:
            child = node.children.get(keys[i])
            if child is None:
                leaf = Node(node, keys[i:], ids[i:], None, clock)
                node.children[keys[i]] = leaf
                node = leaf
                break
            edge = child.keys
            n = len(edge)
            if n > 1 and keys[i : i + n] != edge:  # a one-page edge matched by the lookup
                n = _common_len(edge, keys, i)
                child = self.split(child, n)
            child.last_access = clock
            if child.device is None:  # the node had left the device: it adopts the caller's ids
                child.device = ids[i : i + n]
            held += child.device
            node, i = child, i + n
        return node, _duplicates(ids, held)

    def insert_host(
        self, parent: Node, keys: list[int], host_ids: list[int], spare: list[int]
    ) -> list[tuple[Node, bool]]:
        """Hang pages read from storage under `parent` as host pages marked stored.

        Returns the nodes walked, each with True where it got its host ids here; the ids of
        pages that already had a host copy are appended to `spare` for the caller to free.
        """
        assert len(keys) == len(host_ids), "one host page per key"
        node, i, walked = parent, 0, []
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                leaf = Node(node, keys[i:], None, list(host_ids[i:]), self.clock)
                leaf.in_storage = True
                node.children[keys[i]] = leaf
                walked.append((leaf, True))
                return walked
            n = _common_len(child.keys, keys, i)
            if n < len(child):
                child = self.split(child, n)
            fresh = child.host is None
            if fresh:
                child.host = list(host_ids[i : i + n])
            else:
                spare.extend(host_ids[i : i + n])
            child.in_storage = True
            walked.append((child, fresh))
            node, i = child, i + n
        return walked

    def remove_leaf(self, node: Node) -> None:
        """Unlink a leaf that has left every tier."""
        assert not node.children and node.parent is not None, "only leaves are removed"
        del node.parent.children[node.keys[0]]
        node.parent = None

    def lock(self, node: Node) -> None:
        """Protect `node` and its ancestors from eviction (a running request uses them)."""
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    # ---- inspection ---------------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_keys(self, node: Node) -> list[int]:
        """All keys from the root down to and including `node`."""
        parts: list[list[int]] = []
        while node is not self.root:
            parts.append(node.keys)
            node = node.parent  # type: ignore[assignment]
        return [k for part in reversed(parts) for k in part]

    def check_integrity(self) -> None:
        """Structural and tier invariants; raises AssertionError on the first broken one."""
        for node in self.nodes():
            assert node.parent is not None and node.parent.children.get(node.keys[0]) is node
            assert node.keys, "empty edge"
            assert node.device is not None or node.host is not None, "node in no tier"
            for ids in (node.device, node.host):
                assert ids is None or len(ids) == len(node.keys), "tier ids misaligned with keys"
            if node.device is not None and node.parent is not self.root:
                assert node.parent.device is not None, "device set not ancestor-closed"
            assert node.lock_ref >= 0 and node.pins >= 0
            assert node.lock_ref <= node.parent.lock_ref or node.parent is self.root
            for k, child in node.children.items():
                assert child.keys[0] == k


def _duplicates(ids: list[int], held: list[int]) -> list[int]:
    """The caller's ids of pages the tree holds under other ids (theirs to free), in order; one
    C-level pass over the matched span instead of Python work per node."""
    mine = ids[: len(held)]
    if mine == held:  # the caller passed the ids it matched: nothing to free
        return []
    return list(compress(mine, map(ne, mine, held)))


def _common_len(edge: list[int], keys: list[int], start: int) -> int:
    """Length of the common prefix of `edge` and keys[start:] (edge[0] is known to match)."""
    n = min(len(edge), len(keys) - start)
    if edge[:n] == keys[start : start + n]:
        return n
    i = 1
    while edge[i] == keys[start + i]:  # stops before n: the slices differ
        i += 1
    return i


def _head(ids: list[int] | None, n: int) -> list[int] | None:
    return None if ids is None else ids[:n]


def _tail(ids: list[int] | None, n: int) -> list[int] | None:
    return None if ids is None else ids[n:]

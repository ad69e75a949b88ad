"""Nodes and matches of the paged radix tree (radix.py), and the edge-compare helpers of its walks.

A node is one edge: a run of page keys (and, where known, their token bytes) sharing one
tier state. Tensor-free.
"""

from __future__ import annotations

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
        "keep",
        "hits",
        "last_access",
        "tokens",
        "tindex",
        "seed",
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
        self.pins = 0  # copies reading or writing its pages (they land before it may go)
        self.keep = 0  # client pins (cache/pins.py) whose prefix covers it
        self.hits = 0
        self.last_access = clock
        self.tokens: bytes | None = None  # token bytes of the edge's pages, if known
        self.tindex: dict[bytes, Node] | None = None  # children with tokens, by first page bytes
        self.seed: int | None = None  # namespace seed of a child of the root with tokens

    def __len__(self) -> int:
        return len(self.keys)

    def __lt__(self, other: Node) -> bool:  # heap tie-break: deterministic by first key
        return self.keys[0] < other.keys[0]

    @property
    def busy(self) -> bool:
        """A request uses it or a copy reads or writes it: no tier may drop it now."""
        return self.lock_ref > 0 or self.pins > 0

    @property
    def evictable(self) -> bool:
        return self.lock_ref == 0 and self.pins == 0 and self.keep == 0

    def has_device_child(self) -> bool:
        return any(c.device is not None for c in self.children.values())


class Match:
    """The longest cached prefix of a key chain, split by tier (a plain slotted class: one is
    made per lookup, on the admission path).

    - device_ids: device page ids of the leading pages resident on the device;
    - host_nodes: nodes after the device prefix whose pages are only in host memory, in order;
    - device_node: deepest matched node that is on the device (root if none);
    - last_node: deepest matched node (the end of the device + host prefix).
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
        # most matches have no host-only nodes: skip making a generator (read per admission)
        return sum([len(n.keys) for n in self.host_nodes]) if self.host_nodes else 0

    @property
    def pages(self) -> int:
        return self.device_pages + self.host_pages


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

"""Paged radix tree over chained page keys (tensor-free).

Each edge holds a run of page keys and, per tier, where those pages live: `device` (device logical
page ids), `host` (host page ids) and `in_storage` (written to storage). An edge may also hold its
pages' token bytes (2 or 4 bytes an id, one width per namespace: `RadixTree.widths`): then it is
found by them too, so a request's prompt is matched without hashing it (`match_chain`); the keys of
the matched pages come from the nodes. Children are indexed twice: by first key (`children`,
every node) and by the first page's token bytes (`tindex`, nodes with tokens; at the root one
index per namespace seed, `RadixTree.top`). Token bytes are an in-memory index only: a page's
identity stays its chained xxh3 key, and `check_integrity` rehashes every node's tokens to its
keys. Tier invariants:
- every node except the root is on the device, on the host, or both;
- the device-resident nodes are closed under ancestors (eviction from device memory is leaf-first),
  so a match is a device prefix followed by host-only pages;
- a node with `lock_ref > 0` (a running request uses it) or `pins > 0` (a copy reads it) is never
  evicted from any tier; one with `keep > 0` (a client's pin, cache/pins.py) never from the host
  tier, and from the device only once unpinned pages are gone and it has a host copy.
Time is a logical clock (one tick per match/insert), identical on every rank, never wall time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstrata.cache.native import token_walk
from kvstrata.cache.radix_node import (
    Match,
    Node,
    _common_len,
    _duplicates,
    _head,
    _tail,
)

if TYPE_CHECKING:
    from kvstrata.cache.chain import PageChain

__all__ = ["Match", "Node", "RadixTree"]


class RadixTree:
    """Prefix tree keyed by page keys; the cache manager owns tier moves and accounting."""

    def __init__(self) -> None:
        self.root = Node(None, [], device=[], host=[])
        self.clock = 0
        # per namespace seed: the root's children with tokens, by their first page's bytes
        self.top: dict[int, dict[bytes, Node]] = {}
        # per namespace seed: bytes per token id of its nodes' tokens (2 or 4; chain.py)
        self.widths: dict[int, int] = {}

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, keys: list[int], touch: bool = True) -> Match:
        """Longest cached prefix of `keys`; splits a partially matched edge at the match end."""
        self.clock += 1
        device_ids: list[int] = []
        host_nodes: list[Node] = []
        node, device_node = self._key_walk(
            self.root, self.root, keys, 0, touch, device_ids, host_nodes
        )
        return Match(device_ids, host_nodes, device_node, node)

    def _key_walk(
        self,
        node: Node,
        device_node: Node,
        keys: list[int],
        i: int,
        touch: bool,
        device_ids: list[int],
        host_nodes: list[Node],
    ) -> tuple[Node, Node]:
        """Walk keys[i:] down from `node`, appending to the match lists; returns (last node,
        deepest device node). Hot path: one dict lookup and one C-level list comparison per
        node, no per-key Python work unless the match ends inside an edge."""
        clock, total = self.clock, len(keys)
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
        return node, device_node

    def match_chain(self, chain: PageChain, n_pages: int, touch: bool = True) -> Match:
        """Longest cached prefix of the chain's first n_pages, found by token bytes: no page is
        hashed for the pages the tree holds; their keys, read from the nodes, go to
        `chain.learn`. Where the walk stops at a node with children known only by key, the
        rest of the chain is hashed and the walk goes on by key (same result as `match`)."""
        if chain.data is None:
            return self.match(chain.keys[:n_pages], touch)
        if self.widths.get(chain.seed, chain.width) != chain.width:
            raise ValueError(
                f"a chain of {chain.width}-byte token ids against a tree holding "
                f"{self.widths[chain.seed]}-byte ones in the same namespace"
            )
        self.clock += 1
        limit = min(n_pages, chain.pages) * chain.page_bytes
        device_ids: list[int] = []
        host_nodes: list[Node] = []
        node, device_node, off, partial = self._token_walk(
            chain, limit, touch, device_ids, host_nodes
        )
        if off < limit and not partial and self._has_key_only_child(node):
            rest = chain.keys_upto(limit // chain.page_bytes)
            node, device_node = self._key_walk(
                node, device_node, rest, off // chain.page_bytes, touch, device_ids, host_nodes
            )
        return Match(device_ids, host_nodes, device_node, node)

    def _token_walk(
        self, chain: PageChain, limit: int, touch: bool, device_ids: list[int], host: list[Node]
    ) -> tuple[Node, Node, int, bool]:
        """match_chain's walk by token bytes up to byte `limit` (splitting a partly matched
        edge): (last node, last device node, bytes matched, stopped inside an edge). The path
        is found natively (`token_walk`: one dict lookup and one memcmp per edge); here each
        walked node is touched and read by tier, and its keys go to `chain.learn`."""
        assert chain.data is not None
        index = self.top.get(chain.seed)
        path, off, cut = token_walk(index, chain.data, limit, chain.page_bytes)
        if cut:  # the request leaves or ends inside the last node: only its matched pages
            path[-1] = self.split(path[-1], cut)
            off += cut * chain.page_bytes
        clock, keys = self.clock, []
        node = device_node = self.root
        for node in path:
            if touch:
                node.last_access = clock
                node.hits += 1
            keys += node.keys
            if node.device is not None:
                device_ids += node.device
                device_node = node
            else:
                host.append(node)
        chain.learn(keys)
        return node, device_node, off, cut > 0

    def _has_key_only_child(self, node: Node) -> bool:
        if node is self.root:
            return len(node.children) > sum(len(d) for d in self.top.values())
        return len(node.children) > (len(node.tindex) if node.tindex else 0)

    def _index_of(self, node: Node) -> dict[bytes, Node]:
        """The token index `node` (which has tokens) is listed in: its parent's, or the root's
        for its namespace."""
        parent = node.parent
        assert parent is not None
        if parent is self.root:
            assert node.seed is not None, "a child of the root with tokens has a seed"
            return self.top.setdefault(node.seed, {})
        if parent.tindex is None:
            parent.tindex = {}
        return parent.tindex

    def _give_tokens(self, node: Node, tokens: bytes, seed: int, width: int) -> None:
        """`node` learns its pages' token bytes (`width` bytes an id) and joins its parent's
        token index."""
        p = len(tokens) // len(node.keys)
        assert p * len(node.keys) == len(tokens), "token bytes misaligned with keys"
        known = self.widths.setdefault(seed, width)
        assert known == width, f"{width}-byte token ids into a namespace of {known}-byte ones"
        node.tokens = tokens
        node.seed = seed if node.parent is self.root else None
        index, first = self._index_of(node), tokens[:p]  # one slice: its hash is kept
        assert index.get(first, node) is node, "two children with the same first page"
        index[first] = node

    def split(self, node: Node, n: int) -> Node:
        """Cut `node` after its first n pages; returns the new upper node (which keeps the stats)."""
        assert 0 < n < len(node), "split point must be inside the edge"
        upper = Node(
            node.parent, node.keys[:n], _head(node.device, n), _head(node.host, n), node.last_access
        )
        upper.in_storage, upper.lock_ref, upper.pins, upper.keep, upper.hits = (
            node.in_storage,
            node.lock_ref,
            node.pins,
            node.keep,
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
        tokens = node.tokens
        if tokens is not None:  # the upper part takes the lower's place in the token index
            p = len(tokens) // (n + len(node))
            upper.tokens, node.tokens = tokens[: n * p], tokens[n * p :]
            upper.seed, node.seed = node.seed, None
            self._index_of(upper)[tokens[:p]] = upper
            upper.tindex = {node.tokens[:p]: node}
        return upper

    # ---- update -------------------------------------------------------------------------------
    def insert(
        self,
        keys: list[int],
        device_ids: list[int],
        tokens: bytes | None = None,
        seed: int = 0,
        below: Node | None = None,
        width: int = 4,
    ) -> tuple[Node, list[int]]:
        """Cache `keys` with their device pages. Returns (last node, ids the caller must free).

        Pages already on the device keep their existing ids (the caller's duplicates come back
        to be freed); matched nodes that had left the device adopt the caller's ids. The tree
        keeps its own copies of the id lists (slices), never the caller's list. `tokens`: the
        pages' token bytes (and `seed`, their namespace's root key; `width`, bytes per id): new
        nodes, and walked nodes without tokens, take theirs. `below`: the keys continue the path to this node
        (the root if None), which the caller holds locked, so the walk starts there.
        """
        assert len(keys) == len(device_ids), "one device page per key"
        ids = device_ids if type(device_ids) is list else list(device_ids)
        p = len(tokens) // len(keys) if tokens and keys else 0
        self.clock += 1
        clock = self.clock
        node, i, total = self.root if below is None else below, 0, len(keys)
        assert node is self.root or node.parent is not None, "insert below a removed node"
        held: list[int] = []  # the tree's ids of keys[:i] (after adoption), compared at the end
        while i < total:
            child = node.children.get(keys[i])
            if child is None:
                node = self._add_leaf(node, keys[i:], ids[i:], None, (tokens, i * p, seed, width))
                break
            edge = child.keys
            n = len(edge)
            if n > 1 and keys[i : i + n] != edge:  # a one-page edge matched by the lookup
                n = _common_len(edge, keys, i)
                child = self.split(child, n)
            child.last_access = clock
            if child.device is None:  # the node had left the device: it adopts the caller's ids
                child.device = ids[i : i + n]
            if tokens is not None and child.tokens is None:
                self._give_tokens(child, tokens[i * p : (i + n) * p], seed, width)
            held += child.device
            node, i = child, i + n
        return node, _duplicates(ids, held)

    def _add_leaf(
        self,
        parent: Node,
        keys: list[int],
        device: list[int] | None,
        host: list[int] | None,
        tokens_from: tuple[bytes | None, int, int, int],
    ) -> Node:
        """A new leaf under `parent`, keeping the id lists given (callers pass fresh slices);
        tokens_from: (the request's token bytes or None, this leaf's first byte, the seed, bytes
        per id)."""
        leaf = Node(parent, keys, device, host, self.clock)
        parent.children[keys[0]] = leaf
        tokens, at, seed, width = tokens_from
        if tokens is not None:
            self._give_tokens(leaf, tokens[at:], seed, width)
        return leaf

    def insert_host(
        self,
        parent: Node,
        keys: list[int],
        host_ids: list[int],
        spare: list[int],
        tokens: bytes | None = None,
        seed: int = 0,
        width: int = 4,
    ) -> list[tuple[Node, bool]]:
        """Hang pages read from storage under `parent` as host pages marked stored. Returns the
        nodes walked, each with True where it got its host ids here; the ids of pages that
        already had a host copy go to `spare` for the caller to free. `tokens`/`seed`/`width`:
        `insert`'s.
        """
        assert len(keys) == len(host_ids), "one host page per key"
        p = len(tokens) // len(keys) if tokens and keys else 0
        node, i, walked = parent, 0, []
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                leaf = self._add_leaf(
                    node, keys[i:], None, list(host_ids[i:]), (tokens, i * p, seed, width)
                )
                leaf.in_storage = True
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
            if tokens is not None and child.tokens is None:
                self._give_tokens(child, tokens[i * p : (i + n) * p], seed, width)
            child.in_storage = True
            walked.append((child, fresh))
            node, i = child, i + n
        return walked

    def remove_leaf(self, node: Node) -> None:
        """Unlink a leaf that has left every tier."""
        assert not node.children and node.parent is not None, "only leaves are removed"
        if node.tokens is not None:
            index = self._index_of(node)
            del index[node.tokens[: len(node.tokens) // len(node.keys)]]
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

    def depth(self, node: Node) -> int:
        """Pages from the root down to and including `node`."""
        pages = 0
        while node is not self.root:
            pages += len(node.keys)
            node = node.parent  # type: ignore[assignment]
        return pages

    def path_keys(self, node: Node) -> list[int]:
        """All keys from the root down to and including `node`."""
        parts: list[list[int]] = []
        while node is not self.root:
            parts.append(node.keys)
            node = node.parent  # type: ignore[assignment]
        return [k for part in reversed(parts) for k in part]

    def check_integrity(self) -> None:
        """Structural, tier and token invariants; raises AssertionError on the first broken one
        (radix_check.py: every node's tokens rehash to its keys, chained from its parent)."""
        from kvstrata.cache.radix_check import check_tree

        check_tree(self)

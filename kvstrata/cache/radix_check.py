"""Integrity of a RadixTree: structure, tiers, and token bytes that rehash to the keys.

Kept apart from radix.py (the hot paths) because it is slow on purpose: every node's token
bytes are hashed again, chained from its parent's last key (or its namespace seed), and must
give exactly the node's keys; every token index lists exactly the children with tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.cache.keys import chain_keys

if TYPE_CHECKING:
    from kvstrata.cache.radix import Node, RadixTree


def check_tree(tree: RadixTree) -> None:
    """Raises AssertionError on the first broken invariant."""
    with_tokens = 0
    for node in tree.nodes():
        _check_node(tree, node)
        with_tokens += node.tokens is not None
    indexed = sum(len(d) for d in tree.top.values())
    indexed += sum(len(n.tindex) for n in tree.nodes() if n.tindex)
    assert indexed == with_tokens, f"{indexed} index entries for {with_tokens} nodes with tokens"


def _check_node(tree: RadixTree, node: Node) -> None:
    parent = node.parent
    assert parent is not None and parent.children.get(node.keys[0]) is node
    assert node.keys, "empty edge"
    assert node.device is not None or node.host is not None, "node in no tier"
    for ids in (node.device, node.host):
        assert ids is None or len(ids) == len(node.keys), "tier ids misaligned with keys"
    if node.device is not None and parent is not tree.root:
        assert parent.device is not None, "device set not ancestor-closed"
    assert node.lock_ref >= 0 and node.pins >= 0 and node.keep >= 0
    assert node.keep <= parent.keep or parent is tree.root, "a pin must cover its ancestors"
    assert node.lock_ref <= parent.lock_ref or parent is tree.root
    for k, child in node.children.items():
        assert child.keys[0] == k
    if node.tokens is None:
        assert node.seed is None, "a seed without tokens"
        return
    _check_tokens(tree, node)


def _check_tokens(tree: RadixTree, node: Node) -> None:
    tokens, parent = node.tokens, node.parent
    assert tokens is not None and parent is not None
    p = len(tokens) // len(node.keys)
    width = tree.widths.get(_namespace_seed(tree, node), 0)
    assert width in (2, 4), "a namespace with tokens has no token width"
    assert p and p % width == 0 and p * len(node.keys) == len(tokens), "tokens misaligned"
    if parent is tree.root:
        assert node.seed is not None, "a child of the root with tokens has no seed"
        index, chained_from = tree.top.get(node.seed, {}), node.seed
    else:
        assert node.seed is None, "only children of the root carry a seed"
        index, chained_from = parent.tindex or {}, parent.keys[-1]
    assert index.get(tokens[:p]) is node, "node with tokens missing from its token index"
    rehashed = chain_keys(tokens, p, chained_from, width=width)
    assert rehashed == node.keys, "tokens do not rehash to the keys"
    for child in (node.tindex or {}).values():
        assert child.parent is node and child.tokens is not None, "stale token index entry"


def _namespace_seed(tree: RadixTree, node: Node) -> int | None:
    """The seed its ancestor under the root carries (nodes with tokens have parents with
    tokens up to the root: a token index is reached from the root only)."""
    while node.parent is not tree.root:
        node = node.parent  # type: ignore[assignment]
    return node.seed

"""The tree walked by token bytes: same answers as the walk by keys, hashing only new pages.

A twin pair of trees gets the same random operations: one keeps token bytes (the engine's way),
the other keys only. After every operation both pass check_integrity (which rehashes every
node's tokens to its keys) and have the same structure, and each token match equals the key
match. Key-only inserts into the token tree exercise the fallback (a walk that meets nodes
known only by key hashes the rest and goes on by key).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.cache.chain import PageChain
from kvstrata.cache.keys import Namespace, page_keys
from kvstrata.cache.lease import Lease
from kvstrata.cache.radix import Match, RadixTree
from tests.cache_harness import make_cache, serve

PAGE = 4
NAMESPACES = [Namespace(model_fingerprint="m", page_size=PAGE, tenant_salt=s) for s in ("", "t")]


def _shape(tree: RadixTree) -> list[tuple]:
    """Every node by its path: (path keys, device ids, host ids, in_storage), sorted."""
    rows = []
    for n in tree.nodes():
        rows.append((tuple(tree.path_keys(n)), n.device, n.host, n.in_storage))
    return sorted(rows, key=lambda r: r[0])


def _view(tree: RadixTree, m: Match) -> tuple:
    return (
        m.device_ids,
        [n.keys for n in m.host_nodes],
        tree.path_keys(m.device_node),  # type: ignore[arg-type]
        tree.path_keys(m.last_node),  # type: ignore[arg-type]
    )


# one op: (kind, namespace, tokens, pages); tokens from 3 ids so first pages are often shared
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert_keys", "match", "host", "drop", "insert_host"]),
        st.integers(0, 1),
        st.lists(st.integers(0, 2), min_size=0, max_size=10 * PAGE),
        st.integers(0, 10),
    ),
    min_size=1,
    max_size=40,
)


def _apply(op: tuple, toks_tree: RadixTree, keys_tree: RadixTree, next_id: list[int]) -> None:
    kind, ns_i, toks, n_pages = op
    ns = NAMESPACES[ns_i]
    chain = PageChain.from_tokens(np.array(toks, dtype=np.int32), ns)
    keys = page_keys(np.array(toks, dtype=np.int32), ns)
    ids = list(range(next_id[0], next_id[0] + len(keys)))
    next_id[0] += len(keys)
    if kind == "insert":
        a = toks_tree.insert(keys, ids, chain.tokens(0, len(keys)), chain.seed)
        b = keys_tree.insert(keys, ids)
        assert a[1] == b[1] and toks_tree.path_keys(a[0]) == keys_tree.path_keys(b[0])
    elif kind == "insert_keys":  # a key-only path into the token tree (the fallback)
        assert toks_tree.insert(keys, ids)[1] == keys_tree.insert(keys, ids)[1]
    elif kind == "match":
        m = toks_tree.match_chain(chain, n_pages)
        assert _view(toks_tree, m) == _view(keys_tree, keys_tree.match(keys[:n_pages]))
        assert chain.keys[: m.pages] == keys[: m.pages]  # learned from the nodes
    elif kind == "insert_host":  # pages from storage hung under the match's end
        at = toks_tree.match_chain(chain, n_pages, touch=False)
        bt = keys_tree.match(keys[:n_pages], touch=False)
        rest, hosts = keys[at.pages :], [10_000 + i for i in ids[at.pages :]]
        sa: list[int] = []
        sb: list[int] = []
        toks_tree.insert_host(
            at.last_node, rest, hosts, sa, chain.tokens(at.pages, len(keys)), ns.seed()
        )  # type: ignore[arg-type]
        keys_tree.insert_host(bt.last_node, rest, hosts, sb)  # type: ignore[arg-type]
        assert sa == sb
    else:  # "host": the deepest device node leaves device memory (keeps a host copy); "drop": a leaf goes
        for tree in (toks_tree, keys_tree):
            _evict(tree, kind, n_pages)


def _evict(tree: RadixTree, kind: str, pick: int) -> None:
    """The same choice on both trees: candidates in path order, the pick-th (mod count)."""
    nodes = sorted(tree.nodes(), key=tree.path_keys)
    if kind == "host":
        cand = [n for n in nodes if n.device is not None and not n.has_device_child()]
        if cand:
            n = cand[pick % len(cand)]
            n.host, n.device = [20_000 + d for d in n.device], None  # type: ignore[union-attr]
    else:
        cand = [n for n in nodes if not n.children]
        if cand:
            tree.remove_leaf(cand[pick % len(cand)])


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_token_walk_equals_key_walk_on_random_trees(ops: list[tuple]) -> None:
    toks_tree, keys_tree, next_id = RadixTree(), RadixTree(), [0]
    for op in ops:
        _apply(op, toks_tree, keys_tree, next_id)
        toks_tree.check_integrity()
        keys_tree.check_integrity()
        assert _shape(toks_tree) == _shape(keys_tree)


def test_namespaces_share_first_tokens_but_never_nodes() -> None:
    tree = RadixTree()
    toks = np.arange(12, dtype=np.int32)
    a, b = (PageChain.from_tokens(toks, ns) for ns in NAMESPACES)
    tree.insert(a.keys_upto(3), [0, 1, 2], a.tokens(0, 3), a.seed)
    assert tree.match_chain(b, 3).pages == 0  # same bytes, other tenant: a miss
    assert b.keys == []  # and nothing was hashed for it
    assert tree.match_chain(PageChain.from_tokens(toks, NAMESPACES[0]), 3).device_ids == [0, 1, 2]
    tree.check_integrity()


def test_integrity_rehashes_tokens() -> None:
    tree = RadixTree()
    chain = PageChain.from_tokens(np.arange(8, dtype=np.int32), NAMESPACES[0])
    node, _ = tree.insert(chain.keys_upto(2), [0, 1], chain.tokens(0, 2), chain.seed)
    tree.check_integrity()
    tokens = node.tokens
    assert tokens is not None and tree.top[chain.seed][tokens[:16]] is node
    node.tokens = tokens[:20] + b"\x07" + tokens[21:]  # one byte of page 1: its key is stale
    with pytest.raises(AssertionError, match="rehash"):
        tree.check_integrity()


def test_follow_up_turn_hashes_only_its_new_pages() -> None:
    """Admission (no storage) learns the held pages' keys from the tree and hashes nothing; the
    commit hashes only the new pages; with storage the probe hashes the pages past the match."""
    for storage in (False, True):
        cache, mover = make_cache(device=32, host=32, storage=storage)
        ns = NAMESPACES[0]
        turn1 = np.arange(6 * PAGE + 1, dtype=np.int32)  # 6 full pages + 1 token
        assert serve(cache, mover, PageChain.from_tokens(turn1[:-1], ns)) == (0, 0, 0)
        turn2 = np.concatenate([turn1, np.arange(100, 100 + 3 * PAGE, dtype=np.int32)])
        chain = PageChain.from_tokens(turn2, ns)  # 9 full pages, 37 tokens
        lease = Lease(cache, chain, len(turn2), chain.pages + 1, PAGE)
        lease.advance(0.0, can_schedule=True)
        if storage:
            assert len(chain.keys) == 9  # the probe asked for pages 6..8 (hittable: 9)
            while lease.advance(0.0, can_schedule=True) is False:
                cache.step()
        else:
            assert lease.match is not None and len(chain.keys) == lease.match.pages == 6
        assert chain.keys[:6] == page_keys(turn1, ns)  # read from the tree, equal to hashing
        assert lease.admit() and lease.hits.device == 6
        lease.commit(len(turn2))
        assert chain.keys == page_keys(turn2, ns)
        lease.release()
        cache.drain()
        cache.check_integrity()


def test_pages_from_storage_take_their_tokens() -> None:
    """Pages prefetched from storage join the tree with their token bytes: the next match of the
    same prompt finds them by tokens (a host hit), and integrity rehashes them."""
    ns = NAMESPACES[0]
    toks = np.arange(8 * PAGE, dtype=np.int32)
    cache, mover = make_cache(device=8, host=8)
    serve(cache, mover, PageChain.from_tokens(toks, ns))
    cache.drain()
    fresh, mover2 = make_cache(device=8, host=8)
    mover2.storage = mover.storage  # a new process reading the same store
    assert serve(fresh, mover2, PageChain.from_tokens(toks, ns)) == (0, 0, 8)
    fresh.drain()
    assert all(n.tokens is not None for n in fresh.tree.nodes())
    fresh.check_integrity()
    again = PageChain.from_tokens(toks, ns)
    assert fresh.tree.match_chain(again, 8).pages == 8 and len(again.keys) == 8


def test_two_leases_of_one_prompt_commit_in_chunks_below_their_locked_nodes() -> None:
    """Both admitted before either commits (no hit for the second); each commits chunk by
    chunk below its locked node. The second's chunks find the first's pages: its own ids are
    freed and its page table takes the tree's, and nothing stays locked after release."""
    ns = NAMESPACES[0]
    toks = np.arange(9 * PAGE, dtype=np.int32)
    cache, _ = make_cache(device=32, host=0, storage=False)
    leases = []
    for _ in range(2):
        chain = PageChain.from_tokens(toks, ns)
        lease = Lease(cache, chain, len(toks), chain.pages + 1, PAGE)
        assert lease.advance(0.0, can_schedule=True) and lease.admit()
        leases.append(lease)
    first, second = leases
    assert first.hits.device == second.hits.device == 0
    free_before = cache.tiers.device.num_free
    for tokens in (3 * PAGE, 5 * PAGE, len(toks)):  # chunks of 3, 2 and 4 pages
        first.commit(tokens)
        second.commit(tokens)
        cache.check_integrity()
        n = tokens // PAGE
        assert second.page_table[:n] == first.page_table[:n]
        assert second.locked is first.locked and cache.tree.depth(first.locked) == n
    assert cache.tiers.device.num_free == free_before + 9  # the second's 9 duplicates
    assert cache.match_chain(PageChain.from_tokens(toks, ns), 9).device_ids == first.page_table[:9]
    for lease in leases:
        lease.release()
    assert all(node.lock_ref == 0 for node in cache.tree.nodes())
    cache.check_integrity()

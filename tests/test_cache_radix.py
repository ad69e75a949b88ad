"""Exact expectations for the paged radix tree: match, insert, split, lock, eviction order."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvstrata.cache.keys import Namespace, as_token_array, chain_keys, key_hex, page_keys
from kvstrata.cache.native import token_walk
from kvstrata.cache.radix import RadixTree
from tests.cache_harness import make_cache

NS = Namespace(model_fingerprint="m", page_size=4)


def test_keys_are_chained_deterministic_and_namespaced() -> None:
    toks = np.arange(20, dtype=np.int64)
    keys = page_keys(toks, NS)
    assert len(keys) == 5  # only full pages
    assert keys == page_keys(list(range(20)), NS)
    assert page_keys(toks[:8], NS) == keys[:2]
    assert page_keys(toks[8:], NS, parent_key=keys[1]) == keys[2:]
    changed = toks.copy()
    changed[1] = 99
    assert all(
        a != b for a, b in zip(page_keys(changed, NS), keys, strict=True)
    )  # chain carries change
    for other in (
        Namespace(model_fingerprint="m", page_size=4, tenant_salt="t"),
        Namespace(model_fingerprint="n", page_size=4),
        Namespace(model_fingerprint="m", page_size=4, kv_dtype="float16"),
    ):
        assert not set(page_keys(toks, other)) & set(keys)
    assert len(key_hex(keys[0])) == 32
    # fixed value: keys must not change across runs/processes/machines
    assert key_hex(page_keys([1, 2, 3, 4], NS)[0]) == key_hex(
        page_keys(np.array([1, 2, 3, 4], np.int32), NS)[0]
    )


def test_native_chain_equals_the_xxh3_spec_and_reads_only_its_span() -> None:
    """keys.py's rule, step by step in Python: page i's key is xxh3-128 of its int32 bytes
    seeded by the low 64 bits of key i-1; the native chain must give exactly those ints."""
    rng = np.random.default_rng(5)
    toks = rng.integers(0, 2**31, 4 * 300, dtype=np.int64).astype(np.int32)  # 300 pages of 4
    data, want, key = toks.tobytes(), [], NS.seed()
    for at in range(0, len(data), 16):
        key = xxhash.xxh3_128_intdigest(data[at : at + 16], key & (2**64 - 1))
        want.append(key)
    assert page_keys(toks, NS) == want  # 300 pages: hashed with the GIL released
    assert page_keys(toks[:40], NS) == want[:10]  # 10: under the GIL
    # a span of a bytes-like view, chained after the key before it; a ragged tail has no key
    assert chain_keys(memoryview(toks).cast("B"), 16, want[2], 48, 48 + 16 * 5 + 3) == want[3:8]
    assert chain_keys(data, 16, want[2], 48, 48) == []
    with pytest.raises(ValueError, match="outside the 4800 data bytes"):
        chain_keys(data, 16, NS.seed(), 0, 4801)
    with pytest.raises(ValueError, match="page_bytes must be positive"):
        chain_keys(data, 0, NS.seed())


class _Edge:
    """What token_walk reads of a node: its pages' bytes and its children's token index."""

    def __init__(self, tokens: bytes, tindex: dict[bytes, _Edge] | None = None) -> None:
        self.tokens, self.tindex = tokens, tindex


def test_token_walk_finds_whole_edges_then_the_pages_matched_inside_the_last() -> None:
    p = 4  # page bytes
    leaf = _Edge(bytes(range(8, 20)))  # pages 2..4
    top = _Edge(bytes(range(8)), {leaf.tokens[:p]: leaf})  # pages 0..1
    index = {top.tokens[:p]: top}
    whole = bytes(range(20))
    assert token_walk(index, whole, 20, p) == ([top, leaf], 20, 0)
    assert token_walk(index, whole, 16, p) == ([top, leaf], 8, 2)  # ends inside the leaf
    turned = whole[:12] + b"\xff" * 8
    assert token_walk(index, turned, 20, p) == ([top, leaf], 8, 1)  # turns after its 1st page
    assert token_walk(index, whole, 4, p) == ([top], 0, 1)
    assert token_walk(index, b"\xff" + whole[1:], 20, p) == ([], 0, 0)
    assert token_walk(None, whole, 20, p) == ([], 0, 0)
    with pytest.raises(ValueError, match="outside the 20 data bytes"):
        token_walk(index, whole, 24, p)
    with pytest.raises(TypeError, match="whole pages"):
        token_walk({whole[:p]: _Edge(b"abc")}, whole, 20, p)


def test_bad_tokens_are_rejected() -> None:
    with pytest.raises(TypeError, match="integer"):
        as_token_array(np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="out of range"):
        page_keys([1, 2, 3, 70000], NS, vocab_size=1000)
    with pytest.raises(ValueError, match="out of range"):
        page_keys([-1, 2, 3, 4], NS)
    with pytest.raises(ValueError, match="1-D"):
        as_token_array([[1, 2]])


def test_match_insert_split() -> None:
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    m = tree.match([1, 2, 9])
    assert m.device_ids == [10, 11] and m.host_pages == 0
    # the edge was split at the match end
    assert [n.keys for n in tree.nodes()] == [[1, 2], [3, 4]]
    node, spare = tree.insert([1, 2, 5], [20, 21, 22])
    assert spare == [20, 21]  # already cached pages keep their ids; duplicates come back
    assert tree.match([1, 2, 5]).device_ids == [10, 11, 22]
    assert tree.match([7]).device_ids == []
    tree.lock(node)
    assert [n.lock_ref for n in tree.nodes() if n.keys == [1, 2]] == [1]
    tree.unlock(node)
    tree.check_integrity()


def test_insert_returns_exactly_the_callers_duplicates_and_adopts_left_pages() -> None:
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    tree.match([1, 2, 9])  # split: [1, 2] -> [3, 4]
    lower = next(n for n in tree.nodes() if n.keys == [3, 4])
    lower.device, lower.host = None, [70, 71]  # [3, 4] left the device (host copy only)
    # mixed ids: 10 and 12 are matched, 99 a duplicate, 40/41 land on the device-less node
    node, spare = tree.insert([1, 2, 3, 4, 5], [10, 99, 40, 41, 50])
    assert spare == [99]
    assert lower.device == [40, 41] and node.keys == [5] and node.device == [50]
    assert tree.match([1, 2, 3, 4, 5]).device_ids == [10, 11, 40, 41, 50]
    assert tree.insert([1, 2, 3], [10, 11, 40])[1] == []  # the ids it matched: nothing to free
    tree.check_integrity()


def test_lru_eviction_order_leaf_first() -> None:
    cache, _ = make_cache(device=6, host=0, storage=False)
    for keys in ([1, 2, 3], [1, 2, 4], [5, 6]):
        ids = cache.alloc_device(len(keys))
        assert ids is not None
        cache.insert(keys, ids)
        cache.check_integrity()
    # full (2 + 1 + 1 + 2 = 6 pages). Touch [1,2,3] so [1,2,4]'s leaf is the oldest leaf.
    cache.match([1, 2, 3])
    ids = cache.alloc_device(1)
    assert ids is not None
    assert peek(cache, [1, 2, 4]) == 2  # leaf [4] evicted first
    assert peek(cache, [5, 6]) == 2
    cache.free_device(ids)
    ids = cache.alloc_device(4)  # 1 free + [5,6] (older than [1,2,3]) + leaf [3]
    assert ids is not None
    assert peek(cache, [5, 6]) == 0
    assert peek(cache, [1, 2, 3]) == 2
    cache.check_integrity()
    assert cache.counters.evictions["device"] == 4


def peek(cache: object, keys: list[int]) -> int:
    """Device prefix length without touching the LRU clock of the nodes."""
    return cache.tree.match(keys, touch=False).device_pages  # type: ignore[attr-defined]


def test_lfu_keeps_hot_pages() -> None:
    cache, _ = make_cache(device=4, host=0, storage=False, eviction="lfu")
    for keys in ([1, 2], [3, 4]):
        cache.insert(keys, cache.alloc_device(2))  # type: ignore[arg-type]
    for _ in range(3):
        cache.match([1, 2])
    cache.match([3, 4])  # most recent, but used less
    assert cache.alloc_device(2) is not None
    assert cache.match([1, 2]).device_pages == 2 and cache.match([3, 4]).device_pages == 0


def test_locked_pages_are_never_evicted() -> None:
    cache, _ = make_cache(device=4, host=0, storage=False)
    node = cache.insert([1, 2, 3, 4], cache.alloc_device(4))  # type: ignore[arg-type]
    cache.lock(node)
    assert cache.alloc_device(1) is None
    cache.check_integrity()
    cache.unlock(node)
    assert cache.alloc_device(1) is not None
    cache.check_integrity()

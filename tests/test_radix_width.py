"""Token bytes kept 2 bytes a token (a vocab that fits 16 bits): same keys, same tree, half the
bytes.

A page's key hashes its int32 bytes whatever width the chain keeps, so a 2-byte chain's keys
equal `page_keys` of the same ids (stored keys keep matching). The tree holds one width per
namespace and rehashes 2-byte nodes in check_integrity. The metadata a cached page costs stays
within 256 bytes (deterministic: tracemalloc counts the bytes the tree keeps).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.bench.radix import metadata_bytes_per_page
from kvstrata.cache.chain import PageChain
from kvstrata.cache.keys import Namespace, chain_keys, page_keys, token_width
from kvstrata.cache.radix import RadixTree
from tests.cache_harness import make_cache, serve

PAGE = 4
NS = Namespace(model_fingerprint="m", page_size=PAGE)
VOCAB = 2**16  # the widest vocab kept at 2 bytes: ids up to 65535


def _ids(n: int, seed: int) -> np.ndarray:
    """Random ids over the whole 16-bit range, both ends included."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, n, dtype=np.int32)
    ids[:2] = (0, VOCAB - 1)
    return ids


def test_width_follows_the_vocab() -> None:
    assert [token_width(v) for v in (None, 49_152, 2**16, 2**16 + 1, 152_064)] == [4, 2, 2, 4, 4]


def test_two_byte_chain_hashes_like_int32() -> None:
    ids = _ids(300 * PAGE, seed=1)  # 300 pages: hashed with the GIL released
    chain = PageChain.from_tokens(ids, NS, VOCAB)
    assert chain.width == 2 and len(chain.data or b"") == 2 * ids.size
    assert chain.keys_upto(300) == page_keys(ids, NS)
    short = PageChain.from_tokens(ids[: 10 * PAGE + 3], NS, VOCAB)  # 10 pages + a partial one
    assert short.pages == 10 and short.keys_upto(10) == page_keys(ids[: 10 * PAGE], NS)
    want = page_keys(ids, NS)
    data = ids.astype(np.uint16).tobytes()
    assert chain_keys(data, 2 * PAGE, want[2], 3 * 2 * PAGE, 8 * 2 * PAGE, width=2) == want[3:8]
    with pytest.raises(ValueError, match="token width must be 2 or 4"):
        chain_keys(data, 2 * PAGE, NS.seed(), width=3)


def test_generated_tokens_must_fit_the_width() -> None:
    chain = PageChain.from_tokens(_ids(2 * PAGE, seed=2), NS, VOCAB)
    chain.extend_tokens([VOCAB - 1] * PAGE)
    assert chain.keys_upto(3)[2] == page_keys([VOCAB - 1] * PAGE, NS, parent_key=chain.keys[1])[0]
    with pytest.raises(ValueError, match="does not fit the 2-byte width"):
        chain.extend_tokens([VOCAB] * PAGE)


def test_two_byte_tree_matches_splits_and_rehashes() -> None:
    """Insert, a prompt that turns inside the edge (a split), a shorter match; integrity
    rehashes every 2-byte node; a stale byte is caught; a 4-byte chain in the namespace is
    refused with a clear error."""
    tree = RadixTree()
    a = _ids(8 * PAGE, seed=3)
    chain = PageChain.from_tokens(a, NS, VOCAB)
    tree.insert(chain.keys_upto(8), list(range(8)), chain.tokens(0, 8), chain.seed, None, 2)
    tree.check_integrity()
    b = np.concatenate([a[: 5 * PAGE], _ids(3 * PAGE, seed=4)])
    other = PageChain.from_tokens(b, NS, VOCAB)
    m = tree.match_chain(other, 8)
    assert m.device_ids == [0, 1, 2, 3, 4] and other.keys == page_keys(b[: 5 * PAGE], NS)
    tree.insert(other.keys_upto(8)[5:], [10, 11, 12], other.tokens(5, 8), NS.seed(), m.last_node, 2)
    tree.check_integrity()
    assert tree.widths == {NS.seed(): 2}
    again = PageChain.from_tokens(b, NS, VOCAB)
    assert tree.match_chain(again, 8).device_ids == [0, 1, 2, 3, 4, 10, 11, 12]
    assert again.keys == page_keys(b, NS)  # every key read from the nodes
    with pytest.raises(ValueError, match="2-byte ones in the same namespace"):
        tree.match_chain(PageChain.from_tokens(b, NS), 8)
    leaf = m.last_node.tindex[other.tokens(5, 6)]  # type: ignore[union-attr,index]
    at = 2 * PAGE + 1  # a byte of the leaf's second page (the first is its index entry)
    leaf.tokens = leaf.tokens[:at] + bytes([leaf.tokens[at] ^ 1]) + leaf.tokens[at + 1 :]
    with pytest.raises(AssertionError, match="rehash"):
        tree.check_integrity()


def test_pages_from_storage_keep_two_byte_tokens() -> None:
    """Through a lease and every tier: a storage prefetch hangs 2-byte pages that the next match
    finds by tokens, and the stored keys are the int32 ones."""
    toks = _ids(8 * PAGE, seed=5)
    cache, mover = make_cache(device=8, host=8)
    serve(cache, mover, PageChain.from_tokens(toks, NS, VOCAB))
    cache.drain()
    assert set(page_keys(toks, NS)) <= set(mover.storage)
    fresh, mover2 = make_cache(device=8, host=8)
    mover2.storage = mover.storage  # a new process reading the same store
    assert serve(fresh, mover2, PageChain.from_tokens(toks, NS, VOCAB)) == (0, 0, 8)
    fresh.drain()
    assert all(
        n.tokens is not None and len(n.tokens) == 2 * PAGE * len(n) for n in fresh.tree.nodes()
    )
    fresh.check_integrity()
    again = PageChain.from_tokens(toks, NS, VOCAB)
    assert fresh.tree.match_chain(again, 8).pages == 8 and again.keys == page_keys(toks, NS)


def test_metadata_per_cached_page_within_256_bytes() -> None:
    """10k pages of 64 tokens as the engine inserts them (SmolLM2's vocab: 2 bytes a token)."""
    assert metadata_bytes_per_page(10_000) <= 256

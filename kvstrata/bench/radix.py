"""`kvstrata bench radix`: tree insert/match speed, key hashing cost, metadata bytes per page."""

from __future__ import annotations

import gc
import time
import tracemalloc
from typing import Any

import numpy as np

from kvstrata.bench.registry import BENCHES
from kvstrata.cache.keys import Namespace, page_keys
from kvstrata.cache.radix import RadixTree

PAGE = 64
NS = Namespace(model_fingerprint="bench", page_size=PAGE)


def shared_prefix_set(
    n_seqs: int, seq_len: int, n_prefixes: int, seed: int = 0
) -> list[np.ndarray]:
    """Sequences made of one of `n_prefixes` shared prefixes cut uniformly in 200..1500, then unique."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, 32000, size=(n_prefixes, seq_len), dtype=np.int32)
    seqs = []
    for _ in range(n_seqs):
        seq = rng.integers(0, 32000, size=seq_len, dtype=np.int32)
        cut = int(rng.integers(200, 1501))
        seq[:cut] = prefixes[rng.integers(n_prefixes)][:cut]
        seqs.append(seq)
    return seqs


def time_insert_match(seqs: list[np.ndarray]) -> dict[str, float]:
    """Seconds to hash + insert every sequence, then hash + match every sequence; and the tree
    work alone (keys computed once per request, as the engine does at admission)."""
    tree = RadixTree()
    next_id = 0
    t0 = time.perf_counter()
    for seq in seqs:
        keys = page_keys(seq, NS)
        tree.insert(keys, list(range(next_id, next_id + len(keys))))
        next_id += len(keys)
    t1 = time.perf_counter()
    all_keys = [page_keys(seq, NS) for seq in seqs]
    t2 = time.perf_counter()
    for keys in all_keys:
        tree.match(keys)
    t3 = time.perf_counter()
    tree.check_integrity()
    hash_s = t2 - t1
    return {
        "insert_s": t1 - t0,
        "match_s": hash_s + t3 - t2,
        "hash_s": hash_s,
        "match_tree_s": t3 - t2,
    }


def hash_ns_per_token(tokens: int) -> float:
    arr = np.random.default_rng(1).integers(0, 32000, size=tokens, dtype=np.int32)
    page_keys(arr, NS)  # warm up
    t0 = time.perf_counter()
    page_keys(arr, NS)
    return (time.perf_counter() - t0) / tokens * 1e9


def metadata_bytes_per_page(pages: int) -> float:
    """Bytes the tree retains per cached page (keys, device ids, nodes), measured by tracemalloc.

    Keys are made inside the measurement and the request's own lists dropped, so the 128-bit key
    objects the tree keeps are counted.
    """
    seqs = [
        np.arange(i * 1000 * PAGE, (i + 1) * 1000 * PAGE, dtype=np.int64) % 2**31
        for i in range(pages // 1000)
    ]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tree = RadixTree()
    next_id = 0
    for seq in seqs:
        keys = page_keys(seq, NS)
        tree.insert(keys, list(range(next_id, next_id + len(keys))))
        next_id += len(keys)
        del keys
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / next_id


@BENCHES.register("radix")
def bench_radix(quick: bool) -> dict[str, Any]:
    n = 200 if quick else 1000
    t = time_insert_match(shared_prefix_set(n, 2000, 20))
    long = time_insert_match([np.random.default_rng(2).integers(0, 32000, 200_000, dtype=np.int32)])
    sglang_insert_s, sglang_match_s = 1.2, 0.35  # SGLang RadixCache on this set (issue 2's figures)
    scale = n / 1000
    # a request is hashed once at admission and its keys serve both match and insert
    ours_total = t["insert_s"] + t["match_tree_s"]
    return {
        "sequences": n,
        **t,
        "insert_speedup_vs_sglang": sglang_insert_s * scale / t["insert_s"],
        "match_speedup_vs_sglang": sglang_match_s * scale / t["match_s"],
        "total_speedup_vs_sglang": (sglang_insert_s + sglang_match_s) * scale / ours_total,
        "long_200k_insert_s": long["insert_s"],
        "long_200k_match_s": long["match_s"],
        "hash_ns_per_token": hash_ns_per_token(200_000),
        "metadata_bytes_per_page": metadata_bytes_per_page(100_000 if quick else 1_000_000),
    }

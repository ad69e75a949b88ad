"""The cost of sealed units (`--storage-key-file`): plain unit store vs MAC'd vs encrypted.

Each side is a store of units (the values a unit store writes): a FileStore, or a MooncakeStore
on a master the mooncake bench started (its pages in registered memory, as a host pool's are),
the sealed sides wrapped in SealedStore exactly as open_unit_storage does. Every batch is put (fresh keys) and got
(GETS_PER_PUT times) by the three sides in turn (order rotating), ROUNDS times; each side's time for a batch is its fastest
of the rounds, summed over batches. A busy shared machine only ever adds delay, so the fastest
round is the one closest to the code's own cost, and alternating sides load them alike.
Ratios are plain_time / sealed_time (goal: MAC >= 0.9, encrypted >= 0.8, on a CPU with AES-NI).
The plain side verifies xxh3-64 on get; the sealed sides verify their AES-GCM tag instead, each
unit right after it is read, on one thread (the default). The `*_thread` sides (file only) check
each unit on a second thread while the next is read (`seal_check_thread`, where the machine has
a second core), so one run shows what the overlap gains or costs on the machine at hand.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstrata.storage.base import StorageBackend, register_host_memory
from kvstrata.storage.config import FileStoreConfig
from kvstrata.storage.file_store import FileStore
from kvstrata.storage.sealed import SealedStore
from kvstrata.storage.sealer import SEAL_OVERHEAD, Sealer

BATCH = 64
ROUNDS = 5
GETS_PER_PUT = 10  # reads are cheap and noisier: more tries each (min of 50 per batch)
# a SmolLM2-135M unit (1 layer x 1 K/V head x K,V x 64 tokens x 64 dims x fp32) and a larger one
UNIT_SIZES = (32 * 1024, 256 * 1024)
SIDES = ("plain", "mac", "encrypted")
THREAD_SIDES = ("mac_thread", "encrypted_thread")


StoreOpener = Callable[[str, int], StorageBackend]
"""(side name, value bytes) -> a fresh store of that side's values."""


def _stores(open_store: StoreOpener, unit: int, threads: bool) -> dict[str, StorageBackend]:
    key, sealed = os.urandom(32), unit + SEAL_OVERHEAD
    stores: dict[str, StorageBackend] = {
        "plain": open_store("plain", unit),
        "mac": SealedStore(open_store("mac", sealed), Sealer(key, False), overlap=False),
        "encrypted": SealedStore(open_store("enc", sealed), Sealer(key, True), overlap=False),
    }
    if threads:
        for side, encrypt in zip(THREAD_SIDES, (False, True), strict=True):
            store = open_store(side, sealed)
            stores[side] = SealedStore(store, Sealer(key, encrypt), overlap=True)
    return stores


def _timed(op: Callable[[list[int], list[np.ndarray]], int], keys: list[int], pages: list) -> float:
    """Seconds `op(keys, pages)` took; it must do every page."""
    t0 = time.perf_counter()
    got = op(keys, pages)
    took = time.perf_counter() - t0
    assert got == len(keys), f"sealed bench: {got} of {len(keys)} pages"
    return took


def _round(
    stores: dict[str, StorageBackend],
    batches: list[list[int]],
    src: list[np.ndarray],
    out: list[np.ndarray],
    best: dict[str, np.ndarray],
) -> None:
    """Put then get every batch on every side (fresh keys); keep each batch's fastest times."""
    sides = tuple(stores)
    for b, keys in enumerate(batches):
        order = sides[b % len(sides) :] + sides[: b % len(sides)]
        pages = [src[k % len(src)] for k in keys]
        for side in order:
            t = _timed(stores[side].put, keys, pages)
            best[f"{side}_put"][b] = min(best[f"{side}_put"][b], t)
        for _ in range(GETS_PER_PUT):
            for side in order:
                t = _timed(stores[side].get, keys, out[: len(keys)])
                best[f"{side}_get"][b] = min(best[f"{side}_get"][b], t)
                assert np.array_equal(out[0], pages[0]), f"sealed bench: {side} read wrong bytes"
    for s in stores.values():
        s.delete([k for keys in batches for k in keys])  # the next round writes fresh files


def units_for(unit: int, total: int) -> int:
    return max(BATCH, total // unit)


def _one_size(open_store: StoreOpener, unit: int, total: int, threads: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    src_pool = rng.integers(0, 256, (16, unit), dtype=np.uint8)
    out_pool = np.ones((BATCH, unit), np.uint8)
    src, out = list(src_pool), list(out_pool)
    n = units_for(unit, total)
    stores = _stores(open_store, unit, threads)
    for store in stores.values():  # where a backend moves registered pages in place
        register_host_memory(store, src_pool)
        register_host_memory(store, out_pool)
    best = {f"{s}_{op}": np.full(-(-n // BATCH), np.inf) for s in stores for op in ("put", "get")}
    for r in range(ROUNDS):
        base = r * n + 1  # fresh keys each round: a put of a stored key only refreshes its age
        batches = [
            list(range(lo, min(lo + BATCH, base + n))) for lo in range(base, base + n, BATCH)
        ]
        _round(stores, batches, src, out, best)
    for s in stores.values():
        s.close()
    took = {k: float(v.sum()) for k, v in best.items()}
    row: dict[str, Any] = {"unit_nbytes": unit, "units": n, "rounds": ROUNDS}
    for side in [s for s in stores if s != "plain"]:
        for op in ("put", "get"):
            row[f"{side}_{op}_ratio"] = took[f"plain_{op}"] / took[f"{side}_{op}"]
    for k, v in took.items():
        row[f"{k}_gbps"] = n * unit / v / 1e9
    return row


def sealed_rows(root: str, total: int) -> list[dict[str, Any]]:
    """One row per unit size: put/get ratios of MAC'd and encrypted file units over plain ones."""
    rows = []
    cfg = FileStoreConfig()
    for unit in UNIT_SIZES:
        d = os.path.join(root, f"sealed-{unit}")
        os.makedirs(d, exist_ok=True)
        try:

            def opener(side: str, n: int, d: str = d) -> StorageBackend:
                return FileStore(f"{d}/{side}", n, cfg)

            row = _one_size(opener, unit, total, threads=True)
            rows.append({"backend": "file", **row})
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return rows


def sealed_rows_over(open_store: StoreOpener, total: int) -> list[dict[str, Any]]:
    """The same rows over another backend (each side's store opened by `open_store`)."""
    return [_one_size(open_store, unit, total, threads=False) for unit in UNIT_SIZES]

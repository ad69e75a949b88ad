"""The cost of sealed units (`--storage-key-file`): plain unit store vs MAC'd vs encrypted.

Each side is a FileStore of units (the values a unit store writes), the sealed sides wrapped in
SealedStore exactly as open_unit_storage does. Batches of the three sides alternate (order
rotating), so a busy shared machine loads them alike; times are summed. Ratios are
plain_time / sealed_time (goal: MAC >= 0.9, encrypted >= 0.7, on a CPU with AES-NI).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import numpy as np

from kvstrata.storage.base import StorageBackend, StorageConfig
from kvstrata.storage.file_store import FileStore
from kvstrata.storage.sealed import SEAL_OVERHEAD, SealedStore, Sealer

BATCH = 64
# a SmolLM2-135M unit (1 layer x 1 K/V head x K,V x 64 tokens x 64 dims x fp32) and a larger one
UNIT_SIZES = (32 * 1024, 256 * 1024)
SIDES = ("plain", "mac", "encrypted")


def _stores(root: str, unit: int) -> dict[str, StorageBackend]:
    key = os.urandom(32)
    cfg = StorageConfig()
    return {
        "plain": FileStore(f"{root}/plain", unit, cfg),
        "mac": SealedStore(FileStore(f"{root}/mac", unit + SEAL_OVERHEAD, cfg), Sealer(key, False)),
        "encrypted": SealedStore(
            FileStore(f"{root}/enc", unit + SEAL_OVERHEAD, cfg), Sealer(key, True)
        ),
    }


def _one_size(root: str, unit: int, total: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, unit, dtype=np.uint8) for _ in range(16)]
    out = [np.ones(unit, np.uint8) for _ in range(BATCH)]
    n = max(BATCH, total // unit)
    stores = _stores(root, unit)
    put = dict.fromkeys(SIDES, 0.0)
    get = dict.fromkeys(SIDES, 0.0)
    for turn, lo in enumerate(range(0, n, BATCH)):
        keys = list(range(lo + 1, min(lo + BATCH, n) + 1))
        order = SIDES[turn % 3 :] + SIDES[: turn % 3]
        for side in order:
            t0 = time.perf_counter()
            assert stores[side].put(keys, [src[k % 16] for k in keys]) == len(keys)
            put[side] += time.perf_counter() - t0
        for side in order:
            t0 = time.perf_counter()
            assert stores[side].get(keys, out[: len(keys)]) == len(keys)
            get[side] += time.perf_counter() - t0
        assert np.array_equal(out[0], src[keys[0] % 16]), "sealed bench read wrong bytes"
    for s in stores.values():
        s.close()
    nbytes = n * unit
    row: dict[str, Any] = {"unit_nbytes": unit, "units": n}
    for side in ("mac", "encrypted"):
        row[f"{side}_put_ratio"] = put["plain"] / put[side]
        row[f"{side}_get_ratio"] = get["plain"] / get[side]
    for side in SIDES:
        row[f"{side}_put_gbps"] = nbytes / put[side] / 1e9
        row[f"{side}_get_gbps"] = nbytes / get[side] / 1e9
    return row


def sealed_rows(root: str, total: int) -> list[dict[str, Any]]:
    """One row per unit size: put/get ratios of MAC'd and encrypted units over plain ones."""
    rows = []
    for unit in UNIT_SIZES:
        d = os.path.join(root, f"sealed-{unit}")
        os.makedirs(d, exist_ok=True)
        try:
            rows.append(_one_size(d, unit, total))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return rows

"""The periodic sweep of a file unit store: a writer's next put removes the units of a page
whose backup went stale uncommitted, and only those."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from kvstrata.cache.keys import key_hex
from kvstrata.memory.layout import KVShape
from kvstrata.storage.config import storage_config
from kvstrata.storage.unit_sweep import pending_key
from kvstrata.storage.units import PagePart, open_unit_storage

FULL = KVShape(2, 2, 4, 8)  # 2 layers x 2 K/V heads: 4 units a page


def _units(root: Path) -> int:
    return sum(1 for d in root.iterdir() if len(d.name) == 2 for _ in d.glob("*.kvp"))


def test_put_sweeps_stale_uncommitted_units_every_rescan(tmp_path: Path) -> None:
    cfg = storage_config(stale_tmp_s=1.0, stale_unit_s=30, rescan_interval_s=0.05)
    half = PagePart(FULL, (0, 2), (0, 1))  # one of two tp ranks: 2 units a page
    page = np.ones(half.shape.page_nbytes, np.uint8)
    store = open_unit_storage(str(tmp_path), half, cfg, commit_on_put=False)
    assert store.put([1, 2, 3], [page] * 3) == 3
    assert store.commit([2]) == 1  # page 2 agreed; 1 and 3 wait for the other rank
    assert _units(tmp_path) == 6
    old = time.time() - 60
    os.utime(next(tmp_path.glob(f"pending/*/{key_hex(pending_key(1))}.kvp")), (old, old))
    time.sleep(0.06)  # a rescan is due
    assert store.put([4], [page]) == 1
    assert store.stats()["units_swept"] == 2  # page 1's units (the other rank's never came)
    assert _units(tmp_path) == 6 and store.units.exists_prefix(store._unit_keys(1)) == 0
    assert store.exists_prefix([2]) == 1 and store.units.exists_prefix(store._unit_keys(3)) == 2
    store.check_integrity()
    store.close()

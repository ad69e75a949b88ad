"""The emulated remote-storage read time (`emulate_read_s_per_page`) is per page read, however
many layout units a page is stored as; commit markers wait nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstrata.memory.layout import KVShape
from kvstrata.storage import latency
from kvstrata.storage.base import StorageConfig
from kvstrata.storage.units import PagePart, open_unit_storage

SHAPE = KVShape(3, 2, 8, 4)  # 3 layers x 2 K/V heads: 6 units a page
PER_PAGE_S = 0.25


@pytest.mark.parametrize("heads", [(0, 2), (1, 2)])  # the whole page; one rank's half of it
def test_reads_wait_per_page_not_per_unit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int]
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(latency.time, "sleep", slept.append)
    part = PagePart(SHAPE, (0, 3), heads)
    store = open_unit_storage(
        str(tmp_path), part, StorageConfig(emulate_read_s_per_page=PER_PAGE_S)
    )
    pages = [np.full(part.shape.page_nbytes, i, np.uint8) for i in range(3)]
    assert store.put([11, 12, 13], pages) == 3
    assert store.exists_prefix([11, 12, 13, 14]) == 3
    assert slept == []  # writes and probes are not slowed
    out = [np.zeros(part.shape.page_nbytes, np.uint8) for _ in range(3)]
    assert store.get([11, 12, 13], out) == 3
    assert all((o == p).all() for o, p in zip(out, pages, strict=True))
    assert sum(slept) == pytest.approx(3 * PER_PAGE_S)
    store.close()

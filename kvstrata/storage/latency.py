"""A backend wrapper that makes reads slow, to emulate remote storage on one machine.

`open_storage` applies it when `StorageConfig.emulate_read_s_per_page` > 0: each `get` sleeps
that long per key asked for, before the inner backend reads. A unit store (storage/units.py)
keeps a page as many units, so it opens its unit backend with a unit's share of the per-page time:
a page read waits the configured time whatever its layout. Benchmarks and tests use it to put
a realistic storage read time (a 20 MB page over a 2 GB/s link takes 10 ms) behind a local store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # base.open_storage imports this module: a type here, not an import cycle
    from kvstrata.storage.base import StorageBackend


class SlowReads:
    """Delegates to `inner`; `get` first waits `per_page_s` per key (a page, or a unit)."""

    # what the inner store says, as base.exists_runs_beside_io and reads_run_together read it
    # (base imports this module)
    @property
    def concurrent_exists(self) -> bool:
        return bool(getattr(self.inner, "concurrent_exists", False))

    @property
    def concurrent_reads(self) -> bool:
        return bool(getattr(self.inner, "concurrent_reads", False))

    def __init__(self, inner: StorageBackend, per_page_s: float) -> None:
        if per_page_s < 0:
            raise ValueError(f"per_page_s must be >= 0, got {per_page_s}")
        self.inner, self.per_page_s = inner, per_page_s
        self.page_nbytes = inner.page_nbytes

    def exists_prefix(self, keys: Sequence[int]) -> int:
        return self.inner.exists_prefix(keys)

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        time.sleep(self.per_page_s * len(keys))
        return self.inner.get(keys, out)

    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        return self.inner.put(keys, pages)

    def delete(self, keys: Sequence[int]) -> int:
        return self.inner.delete(keys)

    def stats(self) -> dict[str, int | float]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def check_integrity(self) -> None:
        self.inner.check_integrity()

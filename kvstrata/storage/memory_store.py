"""In-process storage backend (`mem://`): a dict of key -> page bytes, for replays and tests.

Not shared between processes. `MemoryStoreConfig.max_bytes` > 0 bounds it: the oldest written page
goes first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstrata.storage.base import STORAGE_BACKENDS, StorageConfig, check_batch, page_view


class MemoryStorage:
    """StorageBackend in a dict; `max_pages` > 0 bounds it (oldest written first out)."""

    concurrent_exists = True  # a membership test per key: atomic beside a put or delete

    def __init__(self, page_nbytes: int, max_pages: int = 0) -> None:
        if page_nbytes <= 0:
            raise ValueError(f"page_nbytes must be > 0, got {page_nbytes}")
        if max_pages < 0:
            raise ValueError(f"max_pages must be >= 0, got {max_pages}")
        self.page_nbytes, self.max_pages = page_nbytes, max_pages
        self._pages: dict[int, bytes] = {}  # insertion order = write order (FIFO clean-up)
        self._stats = {"puts": 0, "gets": 0, "hits": 0, "evicted": 0}

    def exists_prefix(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self._pages:
                break
            n += 1
        return n

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        check_batch(keys, out, "get")
        self._stats["gets"] += len(keys)
        for i, k in enumerate(keys):
            data = self._pages.get(k)
            if data is None:
                return i
            out[i][:] = np.frombuffer(data, dtype=np.uint8)
            self._stats["hits"] += 1
        return len(keys)

    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        check_batch(keys, pages, "put")
        for k, p in zip(keys, pages, strict=True):
            self._pages[k] = page_view(p, self.page_nbytes, "put").tobytes()
        self._stats["puts"] += len(keys)
        while self.max_pages and len(self._pages) > self.max_pages:
            del self._pages[next(iter(self._pages))]
            self._stats["evicted"] += 1
        return len(keys)

    def delete(self, keys: Sequence[int]) -> int:
        return sum(self._pages.pop(k, None) is not None for k in keys)

    def stats(self) -> dict[str, int | float]:
        return {
            **self._stats,
            "pages": len(self._pages),
            "bytes": len(self._pages) * self.page_nbytes,
        }

    def close(self) -> None:
        self._pages.clear()

    def check_integrity(self) -> None:
        assert all(len(v) == self.page_nbytes for v in self._pages.values()), (
            "page of the wrong size"
        )
        assert not self.max_pages or len(self._pages) <= self.max_pages, "over capacity"


@STORAGE_BACKENDS.register("mem")
def _open_memory(url: str, page_nbytes: int, config: StorageConfig) -> MemoryStorage:
    if url not in ("mem://", "mem"):
        raise ValueError(f"the in-process store takes no location: use 'mem://', got {url!r}")
    return MemoryStorage(page_nbytes, config.memory.max_bytes // page_nbytes)

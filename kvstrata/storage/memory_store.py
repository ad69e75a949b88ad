"""In-process storage backend (`mem://`): a dict of key -> page bytes, for replays and tests.

Not shared between processes. `MemoryStoreConfig.max_bytes` > 0 bounds it: the oldest written page
goes first.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from kvstrata.storage.base import STORAGE_BACKENDS, StorageConfig, check_batch, page_view


class MemoryStorage:
    """StorageBackend in a dict; `max_pages` > 0 bounds it (oldest written first out)."""

    concurrent_exists = True  # a membership test per key: atomic beside a put or delete
    concurrent_reads = True  # a read copies out of the bytes a put left (never changed)

    def __init__(self, page_nbytes: int, max_pages: int = 0) -> None:
        if page_nbytes <= 0:
            raise ValueError(f"page_nbytes must be > 0, got {page_nbytes}")
        if max_pages < 0:
            raise ValueError(f"max_pages must be >= 0, got {max_pages}")
        self.page_nbytes, self.max_pages = page_nbytes, max_pages
        self._pages: dict[int, bytes] = {}  # insertion order = write order (FIFO clean-up)
        self._stats = {"puts": 0, "gets": 0, "hits": 0, "evicted": 0}
        self._lock = threading.Lock()  # guards the counters: reads run on several threads

    def exists_prefix(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self._pages:
                break
            n += 1
        return n

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        check_batch(keys, out, "get")
        hits = 0
        for k, dst in zip(keys, out, strict=True):
            data = self._pages.get(k)
            if data is None:
                break
            dst[:] = np.frombuffer(data, dtype=np.uint8)
            hits += 1
        with self._lock:
            self._stats["gets"] += len(keys)
            self._stats["hits"] += hits
        return hits

    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        check_batch(keys, pages, "put")
        for k, p in zip(keys, pages, strict=True):
            self._pages[k] = page_view(p, self.page_nbytes, "put").tobytes()
        evicted = 0
        while self.max_pages and len(self._pages) > self.max_pages:
            del self._pages[next(iter(self._pages))]
            evicted += 1
        with self._lock:
            self._stats["puts"] += len(keys)
            self._stats["evicted"] += evicted
        return len(keys)

    def delete(self, keys: Sequence[int]) -> int:
        return sum(self._pages.pop(k, None) is not None for k in keys)

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            counts = dict(self._stats)
        return {
            **counts,
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

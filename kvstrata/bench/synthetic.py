"""Synthetic-KV replay model: real cache decisions, deterministic page bytes, no compute.

`SyntheticMover` is a PageMover whose L1/L2 moves finish at once (there are no tensors: the cache
is tensor-free and the replay needs only its decisions) and whose L3 side talks to a real
StorageBackend: a backup writes each page's deterministic bytes (a function of its key), a
prefetch reads them back and counts a page only if its bytes are exactly what was written. So L3
hits at full trace scale are real reads of real stored pages, checked.

`MemoryStorage` is an in-process StorageBackend (dict of key -> bytes) for full-scale replays;
file:// and redis:// backends plug in through kvstrata.storage.open_storage instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstrata.cache.ops import BACKUP, PREFETCH, PROBE, TransferOp
from kvstrata.storage.base import StorageBackend


def synthetic_page(key: int, nbytes: int) -> np.ndarray:
    """[nbytes] uint8: the key's 16 little-endian bytes repeated (a wrong page cannot pass)."""
    pattern = np.frombuffer(key.to_bytes(16, "little"), dtype=np.uint8)
    return np.resize(pattern, nbytes)


class MemoryStorage:
    """StorageBackend in a dict; `max_pages` > 0 bounds it (oldest written first out)."""

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
        if len(keys) != len(out):
            raise ValueError(f"get: {len(keys)} keys but {len(out)} buffers")
        self._stats["gets"] += len(keys)
        for i, k in enumerate(keys):
            data = self._pages.get(k)
            if data is None:
                return i
            out[i][:] = np.frombuffer(data, dtype=np.uint8)
            self._stats["hits"] += 1
        return len(keys)

    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        if len(keys) != len(pages):
            raise ValueError(f"put: {len(keys)} keys but {len(pages)} pages")
        for k, p in zip(keys, pages, strict=True):
            if p.nbytes != self.page_nbytes:
                raise ValueError(f"put: page of {p.nbytes} bytes, expected {self.page_nbytes}")
            self._pages[k] = p.tobytes()
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


class SyntheticMover:
    """PageMover for replays: instant L1/L2 moves, real checked L3 reads and writes."""

    def __init__(self, storage: StorageBackend | None, page_nbytes: int) -> None:
        self.storage, self.page_nbytes = storage, page_nbytes
        self.corrupt_pages = 0

    def submit(self, op: TransferOp) -> None:
        ok = op.pages
        if op.kind in (BACKUP, PROBE, PREFETCH):
            if self.storage is None:
                raise ValueError(f"{op.kind} op submitted without a storage backend")
            ok = self._storage_op(op)
        op.handle = ok  # the op finished here: poll reads the count back

    def _storage_op(self, op: TransferOp) -> int:
        assert self.storage is not None
        if op.kind == BACKUP:
            pages = [synthetic_page(k, self.page_nbytes) for k in op.keys]
            return self.storage.put(op.keys, pages)
        if op.kind == PROBE:
            return self.storage.exists_prefix(op.keys)
        bufs = [np.empty(self.page_nbytes, dtype=np.uint8) for _ in op.keys]
        got = self.storage.get(op.keys, bufs)
        for i in range(got):  # count only the leading pages whose bytes are exactly right
            if not np.array_equal(bufs[i], synthetic_page(op.keys[i], self.page_nbytes)):
                self.corrupt_pages += 1
                return i
        return got

    def poll(self, op: TransferOp) -> int | None:
        return op.handle if isinstance(op.handle, int) else None

    def cancel(self, op: TransferOp) -> None:
        """Moves finish at submission, so there is nothing left to stop."""

    def release(self, op: TransferOp) -> None:
        """Nothing is kept per op beyond op.handle, which goes with the op."""

"""Synthetic-KV replay model: real cache decisions, deterministic page bytes, no compute.

`SyntheticMover` is a PageMover whose device/host moves finish at once (there are no tensors: the
cache is tensor-free and the replay needs only its decisions) and whose storage side talks to a real
StorageBackend: a backup writes each page's deterministic bytes (a function of its key), a
prefetch reads them back and counts a page only if its bytes are exactly what was written. So
storage hits at full trace scale are real reads of real stored pages, checked.

storage reads take time on the replay's clock (`StorageLatency`), so the prefetch policies decide
differently: best_effort stops as soon as the request could run, wait_complete waits for every
page, timeout waits for a budget that grows with the prefetch length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstrata.cache.ops import BACKUP, PREFETCH, PROBE, TransferOp
from kvstrata.storage.base import StorageBackend


def synthetic_page(key: int, nbytes: int) -> np.ndarray:
    """[nbytes] uint8: the key's 16 little-endian bytes repeated (a wrong page cannot pass)."""
    pattern = np.frombuffer(key.to_bytes(16, "little"), dtype=np.uint8)
    return np.resize(pattern, nbytes)


@dataclass(frozen=True)
class StorageLatency:
    """Time a storage read takes in the synthetic model: first byte, then a fixed time per page."""

    first_byte_s: float = 0.0
    per_page_s: float = 0.0

    def done_after(self, pages: int) -> float:
        return self.first_byte_s + self.per_page_s * pages

    def landed(self, elapsed_s: float, pages: int) -> int:
        """Leading pages of a read of `pages` that arrived `elapsed_s` after it started."""
        if elapsed_s < self.first_byte_s:
            return 0
        if self.per_page_s <= 0:
            return pages
        return min(pages, int((elapsed_s - self.first_byte_s) / self.per_page_s))


@dataclass
class _Pending:
    result: int  # pages the storage really read/wrote OK
    started_s: float
    ready_s: float


class SyntheticMover:
    """PageMover for replays: instant device/host moves and backups, checked storage reads that take
    `latency` on the replay's `clock` (probes pay the first byte, prefetches every page)."""

    def __init__(
        self,
        storage: StorageBackend | None,
        page_nbytes: int,
        latency: StorageLatency | None = None,
        clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.storage, self.page_nbytes = storage, page_nbytes
        self.latency, self.clock = latency or StorageLatency(), clock
        self.corrupt_pages = 0

    def submit(self, op: TransferOp) -> None:
        ok = op.pages
        if op.kind in (BACKUP, PROBE, PREFETCH):
            if self.storage is None:
                raise ValueError(f"{op.kind} op submitted without a storage backend")
            ok = self._storage_op(op)
        now = self.clock()
        delay = {PROBE: self.latency.first_byte_s, PREFETCH: self.latency.done_after(ok)}
        op.handle = _Pending(ok, now, now + delay.get(op.kind, 0.0))

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
        p = op.handle
        assert isinstance(p, _Pending), "op was not submitted here"
        return p.result if self.clock() >= p.ready_s else None

    def cancel(self, op: TransferOp) -> None:
        """A stopped prefetch ends now with the pages that have arrived."""
        p = op.handle
        assert isinstance(p, _Pending), "op was not submitted here"
        now = self.clock()
        if now < p.ready_s:
            op.handle = _Pending(self.latency.landed(now - p.started_s, p.result), p.started_s, now)

    def wait_answered(self, op: TransferOp, timeout_s: float) -> None:
        """Ops finish on the model's clock, read as they are polled: nothing to wait for."""

    def release(self, op: TransferOp) -> None:
        """Nothing is kept per op beyond op.handle, which goes with the op."""

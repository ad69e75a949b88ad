"""The real PageMover: moves KV bytes between the device pool, the host pool and storage.

host <-> device copies go through the CopyEngine (per-layer completion); host <-> storage I/O runs
on one storage worker thread in submission order, reading and writing host pages in place (the host
layout is page-first, so a page is one contiguous buffer). The cache manager pins the pages an
op reads until it is applied, so the bytes stay valid while the worker uses them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from kvstrata.cache.ops import BACKUP, LOAD, PREFETCH, PROBE, STORE, TransferOp
from kvstrata.memory.copy_engine import CopyEngine
from kvstrata.memory.pool import DevicePool, HostPool
from kvstrata.storage.base import StorageBackend, put_report, register_host_memory

PREFETCH_CHUNK = 32
"""Pages read per storage call; a stopped prefetch ends at a chunk boundary."""


class TensorMover:
    """PageMover over real pools, a CopyEngine and an optional storage backend."""

    def __init__(
        self, device: DevicePool, host: HostPool | None, storage: StorageBackend | None = None
    ) -> None:
        self.device, self.host, self.storage = device, host, storage
        self.copies = CopyEngine(device, host) if host is not None else None
        self._results: dict[int, int] = {}
        self._lock = threading.Lock()
        # ops, or plain jobs (callables) that run in order with them and report nothing
        self._jobs: queue.Queue[TransferOp | Callable[[], None] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        if storage is not None and host is not None:  # pages then move zero-copy where it can
            register_host_memory(storage, host.data.view(torch.uint8).numpy())
        if storage is not None:
            self._worker = threading.Thread(
                target=self._storage_loop, name="kvstrata-storage", daemon=True
            )
            self._worker.start()

    # ---- PageMover ----------------------------------------------------------------------------
    def submit(self, op: TransferOp) -> None:
        if op.kind in (LOAD, STORE):
            assert self.copies is not None, "device <-> host copies need a host pool"
            if op.kind == LOAD:
                op.handle = self.copies.load(op.src, op.dst)
            else:
                op.handle = self.copies.store(op.src, op.dst)
        else:
            assert self.storage is not None, f"{op.kind} needs a storage backend"
            self._jobs.put(op)

    def poll(self, op: TransferOp) -> int | None:
        if op.kind in (LOAD, STORE):
            if not op.handle.is_done():
                return None
            op.handle.wait()  # re-raises a copy error: a bug, never a silent miss
            return op.pages
        with self._lock:
            return self._results.get(id(op))

    def cancel(self, op: TransferOp) -> None:
        op.cancelled = True  # the worker checks it between chunks

    def release(self, op: TransferOp) -> None:
        with self._lock:
            self._results.pop(id(op), None)

    def close(self) -> None:
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=30)
            self._worker = None
        if self.copies is not None:
            self.copies.close()

    # ---- storage worker -----------------------------------------------------------------------
    def _storage_loop(self) -> None:
        while (op := self._jobs.get()) is not None:
            if callable(op):
                try:
                    op()
                except Exception:  # noqa: BLE001 - storage trouble never crashes the worker
                    pass
                continue
            try:
                res = self._run_storage(op)
            except Exception:  # noqa: BLE001 - storage trouble is a miss, never a crash
                res = 0
            with self._lock:
                self._results[id(op)] = res

    def _run_storage(self, op: TransferOp) -> int:
        assert self.storage is not None and self.host is not None
        if op.kind == PROBE:
            return self.storage.exists_prefix(op.keys)
        if op.kind == BACKUP:
            report = put_report(self.storage, op.keys, [self.host.page_bytes(h) for h in op.src])
            op.written_bytes = report.written_bytes
            return report.stored
        assert op.kind == PREFETCH
        done = 0
        while done < len(op.keys) and not op.cancelled:
            start, end = done, min(done + PREFETCH_CHUNK, len(op.keys))
            got = self.storage.get(
                op.keys[start:end], [self.host.page_bytes(h) for h in op.dst[start:end]]
            )
            done += got
            if got < end - start:
                break  # a miss ends the consecutive hit
        return done

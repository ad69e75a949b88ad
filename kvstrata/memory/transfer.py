"""The real PageMover: moves KV bytes between the device pool, the host pool and storage.

host <-> device copies go through the CopyEngine (per-layer completion); host <-> storage I/O runs
on storage worker threads in submission order (reads together where the store takes them, a
write alone; a probe ahead of queued reads, or beside the reads in progress on a probe thread:
memory.storage_jobs), reading and writing host pages in place (the host
layout is page-first, so a page is one contiguous buffer). The cache manager pins the pages an
op reads until it is applied, so the bytes stay valid while the worker uses them.

A mover moves only this rank's part of every page (one rank: the whole of every page). Under tp x
cp x pp a rank's pools hold its part of each page (its pipeline stage's layers, its tensor-parallel
heads: kvstrata.storage.units.PagePart), and under context parallel a page lives on one owner
rank, owner = logical id % cp, in device *and* host memory: the cache gives a page's host id the
owner of its device id and back (Tiers `like=`), each rank's host pool stores only its 1/cp of the
host ids (the pools' `owns`). So, with no collective at all:
- device -> host store and host -> device load: each rank copies only the pages it owns, own device
  <-> own host;
- host -> storage backup: each rank writes its units (UnitStorage) of the pages its host pool owns;
- storage -> host prefetch: each rank reads its units of the pages whose new host id it owns;
- probe: every rank asks the commit markers (one small value per page).
A store that commits on put (one rank) makes each page visible as it is written. Under several
ranks a backup becomes visible only after the step consensus applied it (agreed: every rank
wrote): then the page's commit writer (RankShare) writes the marker.
`stats()["foreign_backup_bytes"]` counts backup bytes this rank handled that it does not hold
(other ranks' parts or pages): 0 by construction, measured, not assumed.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstrata.cache.ops import BACKUP, LOAD, PREFETCH, PROBE, STORE, TransferOp
from kvstrata.memory.copy_engine import CopyEngine
from kvstrata.memory.pool import DevicePool, HostPool
from kvstrata.memory.storage_jobs import StorageJobs
from kvstrata.storage.base import (
    StorageBackend,
    exists_runs_beside_io,
    put_report,
    reads_run_together,
    register_host_memory,
)
from kvstrata.storage.units import UnitStorage

PREFETCH_CHUNK = 32
"""Pages read per storage call; a stopped prefetch ends at a chunk boundary."""


@dataclass(frozen=True)
class RankShare:
    """What this rank writes of the pages it holds (one rank: all of them, markers with the
    units). Which pages it holds is its pools' (`owns`), which units of each its storage's part.

    unit_writer: False where another rank holds the same units (latent pages, replicated over
    tp): this rank reads them but never writes them. commit_writer: this rank writes the commit
    markers of its pages once a backup is agreed (one rank per cp rank: tp rank 0 of pp stage
    0), where the store does not commit on put. delay = (max_polls, seed), testing: each op
    looks unfinished for a random 0..max_polls polls on this rank (copies, storage reads and
    writes alike)."""

    unit_writer: bool = True
    commit_writer: bool = True
    delay: tuple[int, int] | None = None


WHOLE = RankShare()
"""One rank's share: every page, whole."""


class PollDelay:
    """Testing: holds each op unfinished for a random 0..max_polls polls (RankShare.delay)."""

    def __init__(self, max_polls: int, seed: int) -> None:
        self.max_polls, self._rng = max_polls, random.Random(seed)
        self._left: dict[int, int] = {}

    def hold(self, op: TransferOp) -> bool:
        left = self._left.setdefault(id(op), self._rng.randint(0, self.max_polls))
        if left > 0:
            self._left[id(op)] = left - 1
        return left > 0

    def forget(self, op: TransferOp) -> None:
        self._left.pop(id(op), None)


class TensorMover:
    """PageMover over real pools, a CopyEngine and an optional storage backend, moving this
    rank's share of every page (see the module docstring)."""

    def __init__(
        self,
        device: DevicePool,
        host: HostPool | None,
        storage: StorageBackend | UnitStorage | None = None,
        share: RankShare = WHOLE,
        read_threads: int = 1,
    ) -> None:
        """read_threads: storage reads in flight at once, where the store takes them (else 1)."""
        self.device, self.host, self.storage, self.share = device, host, storage, share
        self.copies = CopyEngine(device, host) if host is not None else None
        # a backup is committed by release() once agreed, not by the store as it is written
        self._commits_later = isinstance(storage, UnitStorage) and not storage.commit_on_put
        self._delay = PollDelay(*share.delay) if share.delay else None
        self.counts = dict.fromkeys(("backup_bytes", "foreign_backup_bytes", "commits"), 0)
        self._results: dict[int, int] = {}
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # a storage op's result came in
        # ops, or plain jobs (callables) that run in order with them and report nothing; probes
        # beside the reads where the store's existence checks may run beside its I/O
        workers = read_threads if reads_run_together(storage) else 1
        self._jobs = StorageJobs(exists_runs_beside_io(storage), workers)
        self._threads: list[threading.Thread] = []
        if storage is not None and host is not None:  # pages then move zero-copy where it can
            register_host_memory(storage, host.data.view(torch.uint8).numpy())
        for i in range(workers if storage is not None else 0):
            self._start(self._storage_loop, f"kvstrata-storage-{i}")
        if storage is not None and self._jobs.probe_lane:
            self._start(self._probe_loop, "kvstrata-storage-probes")

    def _start(self, loop: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=loop, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _mine(self, ids: list[int]) -> list[int]:
        """Positions of the ids (device or host: same owner rule) this rank's pools own."""
        if self.device.n_shards == 1:
            return list(range(len(ids)))
        return [i for i, p in enumerate(ids) if self.device.owns(p)]

    # ---- PageMover ----------------------------------------------------------------------------
    def submit(self, op: TransferOp) -> None:
        if op.kind in (LOAD, STORE):
            assert self.copies is not None, "device <-> host copies need a host pool"
            pos = self._mine(op.src)
            assert pos == self._mine(op.dst), "a page has different owners in device and host"
            copy = self.copies.load if op.kind == LOAD else self.copies.store
            op.handle = copy([op.src[i] for i in pos], [op.dst[i] for i in pos])
        else:
            assert self.storage is not None, f"{op.kind} needs a storage backend"
            self._jobs.put(op)

    def poll(self, op: TransferOp) -> int | None:
        if self._delay is not None and self._delay.hold(op):
            return None
        if op.kind in (LOAD, STORE):
            if not op.handle.is_done():
                return None
            op.handle.wait()  # re-raises a copy error: a bug, never a silent miss
            return op.pages
        with self._lock:
            return self._results.get(id(op))

    def wait_answered(self, op: TransferOp, timeout_s: float) -> None:
        """A storage op's worker result, waited for (a test's poll delay still holds it)."""
        if op.kind in (LOAD, STORE):
            return  # copies: poll reads their handle
        with self._answered:
            self._answered.wait_for(lambda: id(op) in self._results, timeout_s)

    def cancel(self, op: TransferOp) -> None:
        op.cancelled = True  # the worker checks it between chunks

    def release(self, op: TransferOp) -> None:
        """Applied everywhere: an agreed complete backup is committed (marker written)."""
        if self._delay is not None:
            self._delay.forget(op)
        if op.kind == BACKUP and self._commits_later and self.share.commit_writer:
            keys = [op.keys[i] for i in self._mine(op.src)] if op.agreed == op.pages else []
            if keys:
                self._jobs.put(self._commit_job(keys))
        with self._lock:
            self._results.pop(id(op), None)

    def close(self) -> None:
        if self._threads:
            self._jobs.put(None)
            self._jobs.stop_lane()
            for thread in self._threads:
                thread.join(timeout=30)
            self._threads = []
        if self.copies is not None:
            self.copies.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def _commit_job(self, keys: list[int]) -> Callable[[], None]:
        def job() -> None:
            assert isinstance(self.storage, UnitStorage)
            n = self.storage.commit(keys)
            with self._lock:
                self.counts["commits"] += n

        return job

    # ---- storage worker: only this rank's pages and units ---------------------------------------
    def _storage_loop(self) -> None:
        while (op := self._jobs.get()) is not None:
            if callable(op):
                try:
                    op()
                except Exception:  # noqa: BLE001 - storage trouble never crashes the worker
                    pass
            else:
                self._answer(op)
            self._jobs.done(op)

    def _probe_loop(self) -> None:
        """The probe lane: probes that need not wait for the worker's reads."""
        while (op := self._jobs.get_probe()) is not None:
            self._answer(op)
            self._jobs.probe_done()

    def _answer(self, op: TransferOp) -> None:
        try:
            res = self._run_storage(op)
        except Exception:  # noqa: BLE001 - storage trouble is a miss, never a crash
            res = 0
        with self._answered:
            self._results[id(op)] = res
            self._answered.notify_all()

    def _run_storage(self, op: TransferOp) -> int:
        assert self.storage is not None and self.host is not None
        if op.kind == PROBE:
            return self.storage.exists_prefix(op.keys)
        if op.kind == BACKUP:
            return self._backup(op)
        assert op.kind == PREFETCH
        return self._prefetch(op)

    def _backup(self, op: TransferOp) -> int:
        """Write this rank's units of the pages it owns. A store committing on put: the pages
        stored; else all or nothing (release commits the whole op once agreed)."""
        assert self.storage is not None and self.host is not None
        if not self.share.unit_writer:  # another rank holds and writes these very units
            op.written_bytes = 0
            return op.pages
        pos = self._mine(op.src)
        pages = [self.host.page_bytes(op.src[i]) for i in pos]
        foreign = self._foreign_bytes([op.src[i] for i in pos])
        report = put_report(self.storage, [op.keys[i] for i in pos], pages)
        op.written_bytes = report.written_bytes
        with self._lock:
            self.counts["backup_bytes"] += report.written_bytes
            self.counts["foreign_backup_bytes"] += foreign
        if not self._commits_later:
            return report.stored
        return op.pages if report.stored == len(pos) else 0

    def _foreign_bytes(self, host_ids: list[int]) -> int:
        """Bytes of a backup this rank handles but does not hold: pages another cp rank owns,
        units outside its layers x heads. (No collective carries backup bytes at all.)"""
        assert self.host is not None
        per_page = 0
        if isinstance(self.storage, UnitStorage):
            u = self.storage
            (l0, l1), (h0, h1) = u.part.layers, u.part.heads
            outside = sum(1 for (a, b), (c, d) in u.blocks if a < l0 or b > l1 or c < h0 or d > h1)
            per_page = outside * u.layout.unit_nbytes
        not_mine = sum(1 for h in host_ids if not self.host.owns(h))
        return per_page * len(host_ids) + not_mine * self.host.shape.page_nbytes

    def _prefetch(self, op: TransferOp) -> int:
        """Read this rank's units of the pages whose host id it owns, chunk by chunk.

        Returns the index of this rank's first miss (or op.pages): the MIN over ranks is then
        the leading count of pages every owner read."""
        assert self.storage is not None and self.host is not None
        done = 0
        while done < len(op.keys) and not op.cancelled:
            end = min(done + PREFETCH_CHUNK, len(op.keys))
            pos = [done + i for i in self._mine(op.dst[done:end])]
            out = [self.host.page_bytes(op.dst[i]) for i in pos]
            got = self.storage.get([op.keys[i] for i in pos], out)
            if got < len(pos):
                return pos[got]  # a miss ends the consecutive hit
            done = end
        return done

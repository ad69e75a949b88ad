"""The PageMover of one rank of a tp x cp x pp layout: every byte it moves is its own.

A rank's pools hold one *part* of every page (its pipeline stage's layers, its tensor-parallel
heads: kvstrata.storage.units.PagePart). Under context parallel a page lives on one owner
rank, owner = logical id % cp, in device *and* host memory: the cache gives a page's host id the
owner of its device id and back (Tiers `like=`), each rank's host pool stores only its 1/cp of the
host ids. So, with no collective at all:
- device -> host store and host -> device load: each rank copies only the pages it owns, own device
  <-> own host;
- host -> storage backup: each rank writes its units (UnitStorage) of the pages its host pool owns;
- storage -> host prefetch: each rank reads its units of the pages whose new host id it owns;
- probe: every rank asks the commit markers (one small value per page).
A backup becomes visible only after the step consensus applied it (agreed: every rank wrote):
then the page's commit writer (tp rank 0, pp rank 0 of the owner's cp group) writes the marker.
`stats()["foreign_backup_bytes"]` counts backup bytes this rank handled that it does not hold
(other ranks' parts or pages): 0 by construction, measured, not assumed.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvstrata.cache.ops import BACKUP, LOAD, PREFETCH, STORE, TransferOp
from kvstrata.memory.cp_ownership import CPOwnership
from kvstrata.memory.pool import DevicePool, HostPool
from kvstrata.memory.transfer import PREFETCH_CHUNK, TensorMover
from kvstrata.storage.units import PagePart, UnitStorage

__all__ = ["DistMover", "PagePart"]


class DistMover(TensorMover):
    """TensorMover for one rank of a tp x cp x pp layout, with optional injected delays.

    commit_writer: this rank writes the commit markers of the pages its cp rank owns (one rank
    per cp rank: tp rank 0 of pp stage 0). unit_writer: False where another rank holds the same
    units (latent pages, replicated over tp): this rank reads them but never writes them. delay = (max_polls, seed): each op looks unfinished
    for a random 0..max_polls polls on this rank (copies, storage reads and writes alike).
    """

    def __init__(
        self,
        device: DevicePool,
        host: HostPool | None,
        storage: UnitStorage | None,
        commit_writer: bool = True,
        delay: tuple[int, int] | None = None,
        unit_writer: bool = True,
    ) -> None:
        if storage is not None and storage.commit_on_put:
            raise ValueError(
                "DistMover commits after agreement: open storage with commit_on_put=False"
            )
        super().__init__(device, host, storage)  # type: ignore[arg-type]
        self.units = storage
        self.commit_writer = commit_writer
        self.unit_writer = unit_writer
        self.own = CPOwnership(device.n_shards)
        self.rank_cp = device.rank
        self.counts = dict.fromkeys(("backup_bytes", "foreign_backup_bytes", "commits"), 0)
        self._wait: dict[int, int] = {}
        self._rng = random.Random(delay[1]) if delay else None
        self._max_delay = delay[0] if delay else 0

    def _mine(self, ids: list[int]) -> list[int]:
        """Positions of the ids (device or host: same owner rule) this cp rank owns."""
        return self.own.owned(ids, self.rank_cp)[0]

    def submit(self, op: TransferOp) -> None:
        if self.own.cp > 1 and op.kind in (STORE, LOAD):
            assert self.copies is not None, "device <-> host copies need a host pool"
            src, dst = op.src, op.dst
            pos = self._mine(src)
            assert pos == self._mine(dst), "a page has different owners in device and host memory"
            copy = self.copies.load if op.kind == LOAD else self.copies.store
            op.handle = copy([src[i] for i in pos], [dst[i] for i in pos])
            return
        super().submit(op)

    def poll(self, op: TransferOp) -> int | None:
        if self._rng is not None:
            left = self._wait.setdefault(id(op), self._rng.randint(0, self._max_delay))
            if left > 0:
                self._wait[id(op)] = left - 1
                return None
        return super().poll(op)

    def release(self, op: TransferOp) -> None:
        """Applied everywhere: an agreed complete backup is committed (marker written)."""
        self._wait.pop(id(op), None)
        if op.kind == BACKUP and op.agreed == op.pages and self.commit_writer:
            keys = [op.keys[i] for i in self._mine(op.src)]
            if keys:
                self._jobs.put(self._commit_job(keys))
        super().release(op)

    def _commit_job(self, keys: list[int]) -> Callable[[], None]:
        def job() -> None:
            assert self.units is not None
            n = self.units.commit(keys)
            with self._lock:
                self.counts["commits"] += n

        return job

    # ---- storage worker: only this rank's pages and units --------------------------------------
    def _run_storage(self, op: TransferOp) -> int:
        assert self.units is not None and self.host is not None
        if op.kind == BACKUP:
            return self._backup(op)
        if op.kind == PREFETCH:
            return self._prefetch(op)
        return super()._run_storage(op)

    def _backup(self, op: TransferOp) -> int:
        """Write this rank's units of the pages it owns; op.pages when all are in."""
        assert self.units is not None and self.host is not None
        if not self.unit_writer:  # another rank holds and writes these very units
            op.written_bytes = 0
            return op.pages
        pos = self._mine(op.src)
        pages = [self.host.page_bytes(op.src[i]) for i in pos]
        foreign = self._foreign_bytes([op.src[i] for i in pos])
        report = self.units.put_report([op.keys[i] for i in pos], pages)
        stored, op.written_bytes = report.stored, report.written_bytes
        with self._lock:
            self.counts["backup_bytes"] += report.written_bytes
            self.counts["foreign_backup_bytes"] += foreign
        return op.pages if stored == len(pos) else 0

    def _foreign_bytes(self, host_ids: list[int]) -> int:
        """Bytes of a backup this rank handles but does not hold: pages another cp rank owns,
        units outside its layers x heads. (No collective carries backup bytes at all.)"""
        assert self.units is not None and self.host is not None
        u = self.units
        (l0, l1), (h0, h1) = u.part.layers, u.part.heads
        outside = sum(1 for (a, b), (c, d) in u.blocks if a < l0 or b > l1 or c < h0 or d > h1)
        per_page = outside * u.layout.unit_nbytes
        not_mine = sum(1 for h in host_ids if not self.host.owns(h))
        return per_page * len(host_ids) + not_mine * u.page_nbytes

    def _prefetch(self, op: TransferOp) -> int:
        """Read this rank's units of the pages whose host id it owns, chunk by chunk.

        Returns the index of this rank's first miss (or op.pages): the MIN over ranks is then
        the leading count of pages every owner read."""
        assert self.units is not None and self.host is not None
        done = 0
        while done < len(op.keys) and not op.cancelled:
            end = min(done + PREFETCH_CHUNK, len(op.keys))
            pos = [done + i for i in self._mine(op.dst[done:end])]
            out = [self.host.page_bytes(op.dst[i]) for i in pos]
            got = self.units.get([op.keys[i] for i in pos], out)
            if got < len(pos):
                return pos[got]
            done = end
        return done

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

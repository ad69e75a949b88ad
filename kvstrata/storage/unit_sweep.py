"""Removing the units of killed backups: units written whose page was never committed.

A rank killed mid-backup leaves units without a commit marker. They are never visible (probes
ask the markers), but they hold space, so they are removed once they are older than
stale_unit_s (the file and redis configs) since their last write. The bound must exceed the longest a live
backup can take from its first unit to the page's commit: the commit follows at the first step
after every rank reported its units in, and a rank silent for DistConfig.timeout_s (<= 60 s by
default) stops every rank; a single unit write in flight is bounded by stale_tmp_s (enforced
<= stale_unit_s). The default (3600 s) leaves a wide margin for slow storage and for writers on
other hosts whose liveness we cannot see; a page that is written again refreshes its age.

file: each writer records the page in a pending store (DIR/pending, value = the page key)
before its units; the commit removes the record. A sweep (at open and every rescan_interval_s
of writing) takes records older than the bound: committed -> drop the record only; uncommitted
-> drop every unit of the page (all ranks' blocks), then the record.
redis: units are SET with an expiry of stale_unit_s; the commit gives them the store's own
expiry (redis_ttl_s, 0 = none). Redis removes an uncommitted unit by itself; no sweep.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from kvstrata.storage.file_store import PAGE_SUFFIX, FileStore
from kvstrata.storage.redis_store import RedisStore

PENDING_TAG = b"kvstrata-pending-v1"
UnitKeys = Callable[[int], list[int]]  # page key -> the keys of all its units (every rank's)


def pending_key(key: int) -> int:
    return xxhash.xxh3_128_intdigest(PENDING_TAG + key.to_bytes(16, "little"))


class FilePending:
    """The pending records of a file unit store and their sweep."""

    def __init__(self, store: FileStore, stale_s: float, interval_s: float) -> None:
        self.store, self.stale_s, self.interval_s = store, stale_s, interval_s
        self._next = 0.0
        self.counts = {"units_swept": 0, "pending_swept": 0}

    def wrote(self, keys: Sequence[int]) -> None:
        """Before the units of `keys` are written (a rewrite refreshes the record's age)."""
        vals = [np.frombuffer(k.to_bytes(16, "little"), np.uint8).copy() for k in keys]
        self.store.put([pending_key(k) for k in keys], vals)

    def committed(self, keys: Sequence[int], units: UnitKeys) -> None:
        self.store.delete([pending_key(k) for k in keys])

    def maybe_sweep(
        self, is_committed: Callable[[int], bool], drop: Callable[[list[int]], int]
    ) -> None:
        if time.monotonic() >= self._next:
            self.sweep(is_committed, drop)

    def sweep(self, is_committed: Callable[[int], bool], drop: Callable[[list[int]], int]) -> int:
        """Remove the units of every stale uncommitted page; returns how many units went."""
        self._next = time.monotonic() + self.interval_s
        removed, before = 0, self._before()
        for pkey in self._stale(before):
            buf = np.empty(16, np.uint8)
            if self.store.get([pkey], [buf]) != 1:
                continue  # removed meanwhile (a commit, or another sweeper)
            if not self._still_stale(pkey, before):
                continue  # a writer refreshed it since the scan: its backup is live again
            key = int.from_bytes(buf.tobytes(), "little")
            if not is_committed(key):
                removed += drop([key])
            self.store.delete([pkey])
            self.counts["pending_swept"] += 1
        self.counts["units_swept"] += removed
        return removed

    def _before(self) -> int:
        return time.time_ns() - int(self.stale_s * 1e9)

    def _still_stale(self, pkey: int, before: int) -> bool:
        try:  # the store's own path of the record (get() above read it there)
            return os.stat(self.store._path(pkey)).st_mtime_ns < before
        except OSError:
            return False

    def _stale(self, before: int) -> list[int]:
        """Keys of pending records whose file is older than `before` (ns since the epoch)."""
        root, out = os.fspath(self.store.root), []
        with os.scandir(root) as top:
            subs = [e.path for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        for sub in subs:
            with os.scandir(sub) as it:
                for e in it:
                    if e.name.endswith(PAGE_SUFFIX) and _mtime(e) < before:
                        out.append(int(e.name[: -len(PAGE_SUFFIX)], 16))
        return out


def _mtime(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_mtime_ns
    except OSError:
        return 1 << 62  # gone meanwhile: never stale


class RedisExpiry:
    """Uncommitted units expire by themselves; the commit sets the store's own expiry."""

    def __init__(self, store: RedisStore, committed_ttl_s: int) -> None:
        self.store, self.ttl_s = store, committed_ttl_s
        self.counts = {"units_kept": 0}

    def wrote(self, keys: Sequence[int]) -> None:
        pass  # the units' SET carries the expiry (their store's redis_ttl_s = stale_unit_s)

    def committed(self, keys: Sequence[int], units: UnitKeys) -> None:
        n = self.store.set_expiry([u for k in keys for u in units(k)], self.ttl_s)
        self.counts["units_kept"] += n

    def maybe_sweep(
        self, is_committed: Callable[[int], bool], drop: Callable[[list[int]], int]
    ) -> None:
        pass

    def sweep(self, is_committed: Callable[[int], bool], drop: Callable[[list[int]], int]) -> int:
        return 0  # redis expires them

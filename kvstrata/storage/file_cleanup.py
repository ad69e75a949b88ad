"""A file store directory's disk space: the size estimate, the LRU clean-up, the temp sweep.

The size cap counts what the store takes on disk (`du`): the blocks allocated to its page files
and to its fan-out directories, not the payload (small units take a whole block each, and 256
fan-out directories take a block each). Writers and readers keep a running estimate (`add`); a
clean-up rescans the directory, removes the least recently used page files (the LRU clock is the
file mtime) down to `evict_to_fraction` of the cap, removes the fan-out directories it emptied
and replaces the estimate by what it measured. Concurrent clean-ups in several processes may
remove a little more than needed: that is a miss.

Orphan temp files (of writers killed mid-write) are removed on every scan: a temp of this host
once its pid is dead, a temp of another host once older than `stale_tmp_s` (see TempFiles).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Iterator

from kvstrata.storage.config import FileStoreConfig
from kvstrata.storage.tmp_files import TempFiles

PAGE_SUFFIX = ".kvp"
TMP_SUFFIX = ".tmp"


def disk_nbytes(st: os.stat_result) -> int:
    """Bytes a file or directory takes on disk (allocated blocks, as `du` counts them)."""
    return st.st_blocks * 512


def unlink_quiet(path: str) -> bool:
    """Remove a file; False if it is gone already (or cannot be removed)."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def rmdir_quiet(path: str) -> bool:
    """Remove a fan-out directory if empty (never a page: rmdir fails on a non-empty one).
    A writer that finds its directory gone recreates it (FileStore._write_new)."""
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False


class DirCleanup:
    """The size accounting and clean-up of one store directory (`root`) in this process."""

    def __init__(self, root: str, config: FileStoreConfig, tmps: TempFiles) -> None:
        self.root, self.config, self._tmps = root, config, tmps
        self._lock = threading.Lock()  # guards the estimate and counters (threads only)
        self._cleanup_lock = threading.Lock()  # one clean-up at a time per process
        self._estimate = 0
        self._counts = {"evicted": 0, "rescans": 0, "tmp_swept": 0}
        self._next_rescan = 0.0

    @property
    def estimate(self) -> int:
        """Bytes the directory takes on disk, as last measured plus what was added since."""
        return self._estimate

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def add(self, nbytes: int) -> None:
        """Bytes written (> 0) or removed (< 0) by this process since the last rescan."""
        with self._lock:
            self._estimate = max(0, self._estimate + nbytes)

    def maybe_cleanup(self) -> None:
        """After writes: clean up if over the cap or a rescan is due; else sweep temps if due."""
        due = time.monotonic() >= self._next_rescan
        if self.config.max_bytes and (self._estimate > self.config.max_bytes or due):
            self.cleanup()
        elif due:
            self.sweep_tmp()

    def sweep_tmp(self) -> int:
        """Remove the orphan temp files of dead writers; returns how many were removed."""
        if not self._cleanup_lock.acquire(blocking=False):
            return 0
        try:
            removed = sum(1 for _ in self.scan(pages=False))
            with self._lock:
                self._counts["tmp_swept"] += removed
            self._next_rescan = time.monotonic() + self.config.rescan_interval_s
            return removed
        finally:
            self._cleanup_lock.release()

    def _subdirs(self) -> list[str]:
        with os.scandir(self.root) as top:
            return [e.path for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]

    def scan(self, pages: bool = True) -> Iterator[tuple[int, os.stat_result, str]]:
        """(mtime_ns, stat, path) of every page file (none if not `pages`); removes orphan temp
        files on the way, yielding (0, stat, path) for each removed one when not `pages`."""
        stale_before = time.time_ns() - int(self.config.stale_tmp_s * 1e9)
        for sub in self._subdirs():
            try:
                with os.scandir(sub) as it:
                    entries = list(it)
            except OSError:
                continue
            for e in entries:
                is_tmp = e.name.endswith(TMP_SUFFIX)
                if not is_tmp and not pages:
                    continue  # a temp sweep stats temp files only
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile by another process
                if e.name.endswith(PAGE_SUFFIX):
                    yield st.st_mtime_ns, st, e.path
                elif is_tmp and self._tmps.orphan(e.path, e.name, st.st_mtime_ns, stale_before):
                    if unlink_quiet(e.path) and not pages:
                        yield 0, st, e.path

    def cleanup(self) -> None:
        """Rescan the directory; if over the cap, remove the least recently used pages."""
        if not self._cleanup_lock.acquire(blocking=False):
            return  # another thread of this process is cleaning up already
        try:
            files = [(mtime, disk_nbytes(st), path) for mtime, st, path in self.scan()]
            dirs = self._dir_sizes()
            total = sum(size for _, size, _ in files) + sum(dirs.values())
            evicted = 0
            if total > self.config.max_bytes:
                total, evicted = self._evict(files, dirs, total)
            with self._lock:
                self._estimate = total
                self._counts["evicted"] += evicted
                self._counts["rescans"] += 1
            self._next_rescan = time.monotonic() + self.config.rescan_interval_s
        finally:
            self._cleanup_lock.release()

    def _evict(
        self, files: list[tuple[int, int, str]], dirs: dict[str, int], total: int
    ) -> tuple[int, int]:
        """Remove the oldest `files` (mtime, disk bytes, path) and the fan-out `dirs` they leave
        empty until `total` is down to the target; (bytes left, page files removed)."""
        target = self.config.max_bytes * self.config.evict_to_fraction
        left = collections.Counter(os.path.dirname(path) for _, _, path in files)
        for sub in [d for d in dirs if not left[d]]:  # empty already: first to go
            total -= dirs[sub] if rmdir_quiet(sub) else 0
        evicted = 0
        files.sort()
        for _, size, path in files:
            if total <= target:
                break
            if unlink_quiet(path):
                evicted += 1
            total -= size  # gone either way (by us or by another process)
            sub = os.path.dirname(path)
            left[sub] -= 1
            if not left[sub] and rmdir_quiet(sub):  # its last page: the dir goes
                total -= dirs.get(sub, 0)
        return total, evicted

    def _dir_sizes(self) -> dict[str, int]:
        sizes = {}
        for sub in self._subdirs():
            try:
                sizes[sub] = disk_nbytes(os.stat(sub))
            except OSError:
                pass  # removed meanwhile by another process's clean-up
        return sizes

    def check_integrity(self) -> None:
        with self._lock:
            assert self._estimate >= 0, self._estimate
            assert all(v >= 0 for v in self._counts.values()), self._counts

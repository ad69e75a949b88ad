"""File backend: one file per page under a directory, safe for many processes sharing it.

Layout: DIR/<first 2 hex digits>/<32 hex digits>.kvp, each file = 40-byte header + payload (see
`kvstrata.storage.base`). Invariants that hold with any number of writer/reader processes and no
locks:
- a page file under its final name is always complete: writers write a uniquely named temp file in
  the same directory and `os.replace` it into place (atomic on POSIX), so a concurrent reader opens
  either the old complete file, the new complete file, or nothing;
- a reader verifies length, header and xxh3-64 checksum; any mismatch is a miss and the file is
  removed (only if the name still points at the inode that was read, so a freshly replaced good
  page is not thrown away); a file whose intact header names another page size or format (a
  store of another configuration over the same directory: sealed units read without the key)
  is a miss that stays (counted `foreign`);
- the LRU clock is the file mtime, set explicitly (ns) on write and on read; the size cap (what
  the store takes on disk) is kept by a running estimate plus an occasional rescan that removes
  the oldest files (kvstrata.storage.file_cleanup).

Temp files are named `.<page file>.<host tag>.<pid>.<thread>.<seq>.tmp`. A writer removes its temp
on any failure (an exception or a signal unwinding it) and `close()` removes any still open; a
killed writer's orphans are swept when a store opens and every `rescan_interval_s` of writing
(whatever the size cap): a temp of this host is removed once its pid is dead, a temp of another
host (whose pids we cannot see) once it is older than `stale_tmp_s`. A live writer's temp is never
touched: its pid is alive (a reused pid only delays the removal until the age limit).

A get whose caller checks values on another thread while the next are read is
kvstrata.storage.file_overlap's.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np

from kvstrata.cache.keys import key_hex
from kvstrata.storage.base import (
    HEADER_NBYTES,
    STORAGE_BACKENDS,
    KeepCheck,
    Overlap,
    PutReport,
    StorageConfig,
    Verify,
    check_batch,
    check_page_nbytes,
    check_pieces,
    checksum_of_pieces,
    encode_header_of_pieces,
    header_foreign,
    header_ok,
    page_view,
)
from kvstrata.storage.config import FileStoreConfig
from kvstrata.storage.file_cleanup import (
    PAGE_SUFFIX,
    TMP_SUFFIX,
    DirCleanup,
    disk_nbytes,
    unlink_quiet,
)
from kvstrata.storage.file_dirs import resolve_dir
from kvstrata.storage.file_io import read_hashed, transfer_all
from kvstrata.storage.file_overlap import PageFiles, get_overlapped
from kvstrata.storage.tmp_files import TempFiles

__all__ = ["PAGE_SUFFIX", "TMP_SUFFIX", "FileStore", "disk_nbytes", "open_file_store"]
_KEY_LIMIT = 1 << 128
_RD = os.O_RDONLY | os.O_CLOEXEC
_WR = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_COUNTERS = (
    "puts", "put_existing", "put_errors", "gets", "get_hits", "get_misses", "corrupt",
    "read_errors", "exists_queries", "deleted", "evicted", "rescans", "bytes_written", "bytes_read",
    "tmp_swept", "foreign", "rewrites",
)  # fmt: skip
_CLEANUP_COUNTERS = ("evicted", "rescans", "tmp_swept")  # kept by the DirCleanup


class FileStore:
    """Storage pages as files in one directory (the embedded default backend)."""

    concurrent_exists = True  # a stat per page; a page file appears whole (written, renamed)
    concurrent_reads = True  # a read opens its own files, with its own header buffer

    def __init__(self, url: str, page_nbytes: int, config: FileStoreConfig | None = None) -> None:
        self.page_nbytes = check_page_nbytes(page_nbytes)
        self.config = config or FileStoreConfig()
        # owner-only unless asked: storage pages hold every tenant's KV (prompts are recoverable)
        self.file_mode, self.dir_mode = (
            (0o660, 0o770) if self.config.group_access else (0o600, 0o700)
        )
        self.root = resolve_dir(url, self.config.create_dir, self.dir_mode)
        self.file_nbytes = HEADER_NBYTES + self.page_nbytes
        block = os.statvfs(self.root).f_frsize or 4096
        self.file_disk_nbytes = -(-self.file_nbytes // block) * block  # estimate; rescans measure
        self.dir_disk_nbytes = disk_nbytes(os.stat(self.root))
        self._root_s = os.fspath(self.root)
        self._lock = threading.Lock()  # guards the counters (threads only)
        self._counts = dict.fromkeys([c for c in _COUNTERS if c not in _CLEANUP_COUNTERS], 0)
        self._closed = False
        self._tmps = TempFiles(TMP_SUFFIX)
        self.space = DirCleanup(self._root_s, self.config, self._tmps)
        touch = self._touch if self.config.touch_on_read else None
        self._files = PageFiles(
            self.page_nbytes, self.file_nbytes, self._path, touch, self._discard
        )
        self._warned = False
        if self.config.max_bytes:
            self.space.cleanup()
        else:
            self.space.sweep_tmp()

    # ---- paths -------------------------------------------------------------------------------
    def _path(self, key: int) -> str:
        if not 0 <= key < _KEY_LIMIT:
            raise ValueError(f"page key must be a 128-bit non-negative int, got {key!r}")
        h = key_hex(key)
        return f"{self._root_s}/{h[:2]}/{h}{PAGE_SUFFIX}"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"file storage {self._root_s} is closed")

    def _add(self, counts: dict[str, int], nbytes: int = 0) -> None:
        with self._lock:
            for name, v in counts.items():
                self._counts[name] += v
        if nbytes:
            self.space.add(nbytes)

    # ---- queries -----------------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[int]) -> int:
        self._check_open()
        n = 0
        for key in keys:
            try:
                if os.stat(self._path(key)).st_size != self.file_nbytes:
                    break
            except OSError:
                break
            n += 1
        self._add({"exists_queries": 1})
        return n

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        check_batch(keys, out, "get")
        views = [page_view(o, self.page_nbytes, "get out") for o in out]
        return self._get(keys, [[memoryview(v)] for v in views], None)

    def get_verified(
        self, keys: Sequence[int], pieces: Sequence[Sequence[memoryview]], verify: Verify
    ) -> int:
        """As get, each stored payload read in one call into its `pieces` (writable buffers,
        lengths summing to page_nbytes; later values may reuse a piece once verify returned)
        and checked by `verify(i)` right after it lands, while it is still in cache, in place of
        the xxh3 pass: for a caller whose check covers every stored byte (a SealedStore's tag).
        A False is a miss; the file is then removed only if the bytes read fail the checksum
        too (a value intact under its checksum is someone else's, e.g. another key's: it stays)."""
        check_pieces(keys, pieces, self.page_nbytes)
        return self._get(keys, pieces, verify)

    def get_overlapped(
        self, keys: Sequence[int], pieces: Sequence[Sequence[memoryview]], overlap: Overlap
    ) -> int:
        """As get_verified, the checks run on overlap.executor, a group of values per task,
        while the next group is read (see Overlap). Outcomes, counters and files end exactly as
        get_verified's: a value is settled (kept and touched, or its file judged and removed)
        only once every value before it passed, and nothing is read past a value missing or bad
        at read time. Every check started has finished when it returns (none writes into a
        caller's buffer later)."""
        check_pieces(keys, pieces, self.page_nbytes)
        self._check_open()
        counts, freed = get_overlapped(self._files, keys, pieces, overlap)
        self._add(counts, -freed)
        return counts["get_hits"]

    def _get(
        self, keys: Sequence[int], pieces: Sequence[Sequence[memoryview]], verify: Verify | None
    ) -> int:
        self._check_open()
        header = bytearray(HEADER_NBYTES)  # per call: the store may be shared by threads
        counts = {
            "gets": 1, "get_hits": 0, "get_misses": 0, "corrupt": 0, "read_errors": 0, "foreign": 0
        }  # fmt: skip
        freed = 0
        for i, (key, value) in enumerate(zip(keys, pieces, strict=True)):
            ok, gone = self._read_one(key, header, value, counts, verify, i)
            freed += gone
            if not ok:
                counts["get_misses"] += 1
                break
            counts["get_hits"] += 1
        counts["bytes_read"] = counts["get_hits"] * self.page_nbytes
        self._add(counts, -freed)
        return counts["get_hits"]

    def _read_one(
        self,
        key: int,
        header: bytearray,
        value: Sequence[memoryview],
        counts: dict[str, int],
        check: Verify | None,
        index: int,
    ) -> tuple[bool, int]:
        """Read page `key` into `value` (pieces), checked by check(index) if a check is given;
        (ok, bytes of a removed corrupt file)."""
        path = self._path(key)
        try:
            fd = os.open(path, _RD)
        except FileNotFoundError:
            return False, 0
        except OSError:
            counts["read_errors"] += 1
            return False, 0
        try:
            outcome = self._read_fd(fd, key, header, value, check, index)
            if outcome in ("corrupt", "foreign"):
                counts[outcome] += 1
            if outcome == "corrupt":
                return False, self._discard(path, fd)
            if outcome == "ok" and self.config.touch_on_read:
                self._touch(fd)
            return outcome == "ok", 0
        except OSError:
            counts["read_errors"] += 1
            return False, 0
        finally:
            os.close(fd)

    def _read_fd(
        self,
        fd: int,
        key: int,
        header: bytearray,
        value: Sequence[memoryview],
        check: Verify | None,
        index: int,
    ) -> str:
        """One file's outcome: "ok", "corrupt", "foreign" (an intact header of another size or
        format) or "rejected" (the caller's check failed, the checksum holds: left in place).
        Unchecked reads (a `check`) skip the payload checksum unless the check fails."""
        if check is None:
            n, actual = read_hashed(fd, header, value[0])
        else:
            n = transfer_all(os.readv, fd, [memoryview(header), *value])
        digest = header_ok(header, key, self.page_nbytes) if n == self.file_nbytes else None
        if digest is None:
            return "foreign" if header_foreign(header, key, os.fstat(fd).st_size) else "corrupt"
        if check is None:
            return "ok" if actual == digest else "corrupt"
        if check(index):
            return "ok"
        return "rejected" if checksum_of_pieces(value) == digest else "corrupt"

    @staticmethod
    def _touch(fd: int) -> None:
        """Refresh the LRU clock; a read-only store still serves its pages (no clock then)."""
        now = time.time_ns()
        try:
            os.utime(fd, ns=(now, now))
        except OSError:
            pass

    def _discard(self, path: str, fd: int) -> int:
        """Remove a corrupt page file if `path` still names the inode read through `fd`."""
        try:
            st = os.fstat(fd)
            cur = os.stat(path)
            if (cur.st_ino, cur.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
                return disk_nbytes(st)
        except OSError:
            pass  # already replaced or removed by another process: nothing to clean
        return 0

    # ---- updates -----------------------------------------------------------------------------
    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        return self.put_report(keys, pages).stored

    def put_report(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> PutReport:
        """As put, saying which values it wrote (a value already stored is kept, not written)."""
        check_batch(keys, pages, "put")
        views = [page_view(p, self.page_nbytes, "put") for p in pages]
        return self.write_pieces(keys, ([memoryview(v)] for v in views))

    def put_pieces(self, keys: Sequence[int], values: Iterable[Sequence[memoryview]]) -> int:
        return self.write_pieces(keys, values).stored

    def write_pieces(
        self,
        keys: Sequence[int],
        values: Iterable[Sequence[memoryview]],
        check: KeepCheck | None = None,
    ) -> PutReport:
        """As put, each payload given as pieces written one after another (lengths summing to
        page_nbytes; no copy joins them). `values` is taken in order, one per key, each written
        before the next is taken: a producer may reuse its buffers (a SealedStore's scratch).
        A whole value already stored is kept (its LRU age refreshed) if it verifies: under
        `check` (a sealed store's seal) or else by its size; one that fails is rewritten."""
        self._check_open()
        counts = dict.fromkeys(
            ("puts", "put_existing", "put_errors", "rewrites", "corrupt", "foreign", "read_errors"),
            0,
        )
        added = 0
        for key, value in zip(keys, values, strict=True):
            if sum(v.nbytes for v in value) != self.page_nbytes:
                raise ValueError(f"put: each page must hold {self.page_nbytes} bytes")
            outcome = self._write_one(key, value, check, counts)
            counts[outcome] += 1
            added += self.file_disk_nbytes if outcome == "puts" else 0
        written = counts["puts"] + counts["rewrites"]
        counts["bytes_written"] = written * self.file_nbytes
        self._add(counts, added)
        self.space.maybe_cleanup()
        return PutReport(written + counts["put_existing"], written * self.page_nbytes)

    def _write_one(
        self,
        key: int,
        value: Sequence[memoryview],
        check: KeepCheck | None,
        counts: dict[str, int],
    ) -> str:
        """Write one page atomically unless a good copy is stored; the outcome's counter name."""
        path = self._path(key)
        now = time.time_ns()
        existed = self._keeps(key, path, check, counts)
        if existed == "keep":
            try:
                os.utime(path, ns=(now, now))  # same key = same bytes: refresh its LRU age only
                return "put_existing"
            except OSError:
                existed = "none"  # removed meanwhile (a clean-up): write it anew
        written = self._write_new(key, path, value, now)
        return "rewrites" if written == "puts" and existed == "bad" else written

    def _keeps(self, key: int, path: str, check: KeepCheck | None, counts: dict[str, int]) -> str:
        """What is stored under `key`: "keep" (a whole value that verifies), "bad" or "none"."""
        try:
            if os.stat(path).st_size != self.file_nbytes:
                return "none"
        except OSError:
            return "none"
        if check is None:
            return "keep"
        header = bytearray(HEADER_NBYTES)
        ok, freed = self._read_one(key, header, check.pieces, counts, lambda _: check.keep(key), 0)
        self._add({}, -freed)
        return "keep" if ok else "bad"

    def _write_new(self, key: int, path: str, value: Sequence[memoryview], now: int) -> str:
        tmp = self._tmps.new(path)
        if tmp is None:  # close() ran meanwhile (a signal): start no new temp file
            return "put_errors"
        try:
            try:
                fd = os.open(tmp, _WR, self.file_mode)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), self.dir_mode, exist_ok=True)
                self._add({}, self.dir_disk_nbytes)  # (or another writer made it: rescans fix)
                fd = os.open(tmp, _WR, self.file_mode)
            try:
                bufs = [memoryview(encode_header_of_pieces(key, value)), *value]
                if transfer_all(os.writev, fd, bufs) != self.file_nbytes:
                    raise OSError("short write")
                if self.config.fsync:
                    os.fsync(fd)
                os.utime(fd, ns=(now, now))
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return "puts"
        except OSError as exc:
            unlink_quiet(tmp)
            self._warn_once(exc)
            return "put_errors"
        except BaseException:  # a signal unwinding the writer: leave no temp behind
            unlink_quiet(tmp)
            raise
        finally:
            self._tmps.done(tmp)

    def _warn_once(self, exc: OSError) -> None:
        """The first failed write of this store says why on stderr; later ones are counted."""
        if self._warned:
            return
        self._warned = True
        print(
            f"kvstrata: warning: storage write to {self._root_s} failed: {exc.strerror or exc} "
            "(pages are not stored; further failures only counted in put_errors)",
            file=sys.stderr,
        )

    def delete(self, keys: Sequence[int]) -> int:
        self._check_open()
        removed = 0
        for key in keys:
            try:
                os.unlink(self._path(key))
                removed += 1
            except OSError:
                pass
        self._add({"deleted": removed}, -removed * self.file_disk_nbytes)
        return removed

    # ---- size cap ----------------------------------------------------------------------------
    def sweep_tmp(self) -> int:
        """Remove the orphan temp files of dead writers; returns how many were removed."""
        return self.space.sweep_tmp()

    # ---- bookkeeping -------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        with self._lock:
            counts = dict(self._counts)
        counts.update(self.space.counts())
        out: dict[str, int | float] = {name: counts[name] for name in _COUNTERS}
        out["bytes_estimate"] = self.space.estimate
        out["page_nbytes"] = self.page_nbytes
        out["max_bytes"] = self.config.max_bytes
        return out

    def close(self) -> None:
        """Stop serving; remove any temp a writer of this process left open (a writer thread
        that still finishes finds its temp gone: its rename fails and counts as put_errors)."""
        self._closed = True
        for tmp in self._tmps.close():
            unlink_quiet(tmp)

    def check_integrity(self) -> None:
        """Counters are sane and every page file has the right name, place and size."""
        assert self.root.is_dir(), f"storage directory {self.root} is gone"
        with self._lock:
            assert all(v >= 0 for v in self._counts.values()), self._counts
            c = self._counts
            assert c["get_hits"] + c["get_misses"] >= 0 and c["get_misses"] <= c["gets"], c
        self.space.check_integrity()
        for _, st, path in self.space.scan():
            size = st.st_size
            sub, name = os.path.split(path)
            stem = name[: -len(PAGE_SUFFIX)]
            assert len(stem) == 32 and int(stem, 16) >= 0, f"bad page file name {path}"
            assert os.path.basename(sub) == stem[:2], (
                f"page file {path} is in the wrong fan-out directory"
            )
            assert size == self.file_nbytes or self._foreign_file(path, int(stem, 16), size), (
                f"page file {path} has {size} bytes, expected {self.file_nbytes}"
            )

    @staticmethod
    def _foreign_file(path: str, key: int, size: int) -> bool:
        """A page file of another store configuration (see header_foreign), whole."""
        with open(path, "rb") as f:
            return header_foreign(f.read(HEADER_NBYTES), key, size)


@STORAGE_BACKENDS.register("file")
def open_file_store(url: str, page_nbytes: int, config: StorageConfig) -> FileStore:
    return FileStore(url, page_nbytes, config.file)

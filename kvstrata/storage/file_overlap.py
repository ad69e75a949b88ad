"""A file store's get whose checks run on another thread while the next values are read.

The caller's check (a SealedStore's tag) runs on overlap.executor, one task per group of values,
while the store reads the next group; at most two groups are read ahead of the oldest value not
yet settled, so a caller may reuse pieces every 2 x group values. Outcomes, counters and files
end exactly as a serial get_verified's: a value is settled (kept and touched, or its file judged
and removed) only once every value before it passed, and nothing is read past a value missing or
bad at read time. Every check started has finished when the get returns (none writes into a
caller's buffer later).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvstrata.storage.base import (
    HEADER_NBYTES,
    Overlap,
    checksum_of_pieces,
    header_foreign,
    header_ok,
)
from kvstrata.storage.file_io import transfer_all

_RD = os.O_RDONLY | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class PageFiles:
    """What an overlapped get needs of its file store."""

    page_nbytes: int
    file_nbytes: int  # header + payload
    path: Callable[[int], str]  # a page key's file
    touch: Callable[[int], None] | None  # refresh a hit's LRU clock (fd); None: reads do not
    discard: Callable[[str, int], int]  # remove a corrupt file still named path (fd): bytes freed


@dataclass(slots=True)
class _Checks:
    """One group's check task: how many of its values, from `lo` on, passed (read once)."""

    lo: int
    task: Future[int]
    passed: int = -1

    def ok(self, i: int) -> bool:
        if self.passed < 0:
            self.passed = self.task.result()
        return i - self.lo < self.passed


@dataclass(slots=True)
class _InFlight:
    """A value between its read and its settling."""

    index: int  # its place in the batch
    path: str
    fd: int | None  # open until settled (its file is touched or judged then)
    outcome: str  # known at read time ("missing", "corrupt", "foreign", "read_errors"), or ""
    digest: int = 0  # the header's checksum (a failed check: intact or corrupt)
    verdict: _Checks | None = None  # its group's check


def get_overlapped(
    files: PageFiles,
    keys: Sequence[int],
    pieces: Sequence[Sequence[memoryview]],
    overlap: Overlap,
) -> tuple[dict[str, int], int]:
    """Read and check the leading values (see the module docstring); (the get's counters,
    disk bytes of the corrupt files removed). counters["get_hits"] is how many lead good."""
    counts = {
        "gets": 1, "get_hits": 0, "get_misses": 0, "corrupt": 0, "read_errors": 0, "foreign": 0
    }  # fmt: skip
    flight: collections.deque[_InFlight] = collections.deque()
    group: list[_InFlight] = []  # read, its check not started yet
    freed, ok = 0, True
    try:
        for i, key in enumerate(keys):
            while ok and len(flight) >= 2 * overlap.group:  # a group's pieces come back
                ok, gone = _settle(files, flight.popleft(), pieces, overlap, counts)
                freed += gone
            if not ok:
                break
            item = _read_ahead(files, i, key, pieces[i])
            flight.append(item)
            if item.outcome:
                break  # a miss at read time: nothing after it is read
            group.append(item)
            if len(group) == overlap.group:
                _start_checks(group, overlap)
        if ok:
            _start_checks(group, overlap)
        while ok and flight:
            ok, gone = _settle(files, flight.popleft(), pieces, overlap, counts)
            freed += gone
    finally:
        for item in flight:  # past the first miss: wait for its check, then drop it
            if item.verdict is not None:
                item.verdict.task.exception()
            if item.fd is not None:
                os.close(item.fd)
    counts["get_misses"] = int(counts["get_hits"] < len(keys))
    counts["bytes_read"] = counts["get_hits"] * files.page_nbytes
    return counts, freed


def _start_checks(group: list[_InFlight], overlap: Overlap) -> None:
    """One task checks the group's values in order; its result: how many lead passed."""
    if not group:
        return
    lo, hi = group[0].index, group[-1].index + 1

    def run() -> int:
        for i in range(lo, hi):
            if not overlap.check(i):
                return i - lo
        return hi - lo

    verdict = _Checks(lo, overlap.executor.submit(run))
    for item in group:
        item.verdict = verdict
    group.clear()


def _read_ahead(files: PageFiles, i: int, key: int, value: Sequence[memoryview]) -> _InFlight:
    """Read value i; an outcome known at read time (missing, header wrong, short) is set."""
    path = files.path(key)
    try:
        fd = os.open(path, _RD)
    except FileNotFoundError:
        return _InFlight(i, path, None, "missing")
    except OSError:
        return _InFlight(i, path, None, "read_errors")
    header = bytearray(HEADER_NBYTES)
    try:
        n = transfer_all(os.readv, fd, [memoryview(header), *value])
        digest = header_ok(header, key, files.page_nbytes) if n == files.file_nbytes else None
        if digest is None:
            foreign = header_foreign(header, key, os.fstat(fd).st_size)
            return _InFlight(i, path, fd, "foreign" if foreign else "corrupt")
    except OSError:
        os.close(fd)
        return _InFlight(i, path, None, "read_errors")
    return _InFlight(i, path, fd, "", digest)


def _settle(
    files: PageFiles,
    item: _InFlight,
    pieces: Sequence[Sequence[memoryview]],
    overlap: Overlap,
    counts: dict[str, int],
) -> tuple[bool, int]:
    """The oldest value's verdict, acted on as a serial get does; (ok, bytes of a removed file)."""
    i = item.index
    outcome = item.outcome
    if item.verdict is not None:
        if item.verdict.ok(i):
            outcome = "ok"
        else:
            overlap.failed(i)
            intact = checksum_of_pieces(pieces[i]) == item.digest
            outcome = "rejected" if intact else "corrupt"
    fd, item.fd = item.fd, None
    try:
        if outcome in ("corrupt", "foreign", "read_errors"):
            counts[outcome] += 1
        if outcome == "ok":
            counts["get_hits"] += 1
            if files.touch is not None:
                files.touch(fd)  # type: ignore[arg-type]
        gone = files.discard(item.path, fd) if outcome == "corrupt" and fd is not None else 0
        return outcome == "ok", gone
    finally:
        if fd is not None:
            os.close(fd)

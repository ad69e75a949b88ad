"""Units a reader can trust: a StorageBackend that seals every unit value before its inner
store sees it and opens every one it reads (the format and cipher: kvstrata.storage.sealer).
With a cluster key (StorageConfig.key_file) file, redis, mem and every backend registered later
get it alike.

Names: a sealed unit store names every page by Sealer.name (keyed BLAKE2b of the page key), so a
listing confirms no known prompt and two cluster keys never share a name (a rotated key misses
once, then writes its own units). Healing: a unit that fails to open is replaced by the next
write of it: a file store checks the seal of a unit it finds stored before keeping it (KeepCheck;
else it rewrites it), the others overwrite (Mooncake after the failed unit is removed).

Reads: each unit is checked right after it lands, while its bytes are in the core's cache, by a
check built once per get (Sealer.mac_check / decrypt_check: the label's fixed parts, the tail's
views and the writer's key are set up once, so a unit costs one AES-GCM call and a
constant-time compare). MAC only: the body is read straight into the caller's page and the tail
into its own 44 bytes; encrypt: the value into one reused scratch (hot in L2), decrypted from
there into the page. Measured on a 2-core VAES machine, 64 units of 256 KiB from the page
cache: decrypting in place in the page (read into it cold, then decrypt) was no faster than the
hot scratch (the page is written once either way), streaming GCM over chunks as they land was
slower (a streaming context costs 5-7 us), and decrypting from a mapping of the file saved ~2 us
a unit but a file cut by another process while mapped would kill the reader (SIGBUS).
A store that reads a batch while the one before is checked (Mooncake: `reuse_after`) gets the
tails, and for encrypted units a ring of `reuse_after` landing places, in memory registered with
it, so every byte of a get moves in place (no staging copy).
Opt-in (`overlap`): a file store's units are checked on a second thread, a group at a time,
while the next group is read (FileStore.get_overlapped); same outcomes as the serial one.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvstrata.storage.base import (
    KeepCheck,
    Overlap,
    PutReport,
    StorageBackend,
    check_batch,
    exists_runs_beside_io,
    page_view,
    put_report,
    register_host_memory,
)
from kvstrata.storage.file_store import FileStore
from kvstrata.storage.sealer import (
    SEAL_OVERHEAD,
    TAG,
    Failed,
    Sealer,
    SealTail,
    seal_tail,
)

CHECK_GROUP_BYTES = 1024 * 1024
"""Stored bytes per check task of an overlapped get (a file store reads the next group while
the verifier thread checks this one): enough that a hand-off between threads is small beside
it, few enough that two groups stay in the core's cache."""
_FAILED_KEPT = 4096  # unit keys that failed to open, remembered for their next write


@dataclass(frozen=True, slots=True)
class Landing:
    """A place one stored encrypted value is read into, and its parts' views."""

    value: list[memoryview]
    """The whole value as get_verified pieces (one piece)."""
    body: memoryview
    """Its ciphertext | tag."""
    tail: SealTail

    @staticmethod
    def at(place: memoryview, unit_nbytes: int) -> Landing:
        return Landing([place], place[: unit_nbytes + TAG], seal_tail(place[unit_nbytes:]))


class SealedStore:
    """A StorageBackend of unit values sealed by `sealer` over `inner` (values 44 bytes longer)."""

    @property
    def concurrent_exists(self) -> bool:
        return exists_runs_beside_io(self.inner)

    def __init__(self, inner: StorageBackend, sealer: Sealer, overlap: bool = False) -> None:
        self.inner, self.sealer = inner, sealer
        # overlap: a file store's units are checked on a second thread while the next are read
        # (where there is a second core); off by default, as FileStoreConfig.seal_check_thread
        self._verifier = (
            ThreadPoolExecutor(1, thread_name_prefix="kvstrata-seal-check")
            if overlap and isinstance(inner, FileStore) and (os.cpu_count() or 1) >= 2
            else None
        )
        self.page_nbytes = inner.page_nbytes - SEAL_OVERHEAD
        if self.page_nbytes <= 0:
            raise ValueError(f"inner store values of {inner.page_nbytes} bytes hold no sealed unit")
        self._lock = threading.Lock()
        self._scratch = threading.local()
        self.counts = {"seal_failures": 0, "sealed": 0, "opened": 0, "rewrites": 0}
        self._failed: OrderedDict[int, None] = OrderedDict()  # unit keys that failed to open

    def exists_prefix(self, keys: Sequence[int]) -> int:
        return self.inner.exists_prefix(keys)

    def register_buffer(self, array: np.ndarray) -> bool:
        """Host memory the inner store may move unit bodies in and out of in place (mooncake):
        a MAC'd unit's body is the page itself."""
        return register_host_memory(self.inner, array)

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        """Leading units read and opened; a unit that fails to open is a miss (and counted).
        A store that reads values in pieces and checks each as it lands (FileStore's
        get_verified) skips its own checksum, since the tag covers every stored byte; it still
        removes a value whose bytes fail its checksum too (corrupt), while a value intact under
        its checksum but not under this key stays (someone else's).
        Bytes land in out[i] before unit i is verified (MAC only: read straight into it) or
        decrypted into it: a unit that fails ends the batch at i, and a caller uses only the
        leading units a get returns (out[i:] are its own unpublished pages, as with a plain
        store's corrupt read), so no unverified byte is ever seen."""
        check_batch(keys, out, "get")
        dst = [memoryview(page_view(o, self.page_nbytes, "get out")) for o in out]  # no copy
        failed = [0]

        def on_failed(i: int) -> None:
            failed[0] += 1
            self._note_failed(keys[i])

        read = getattr(self.inner, "get_verified", None)
        if self._verifier is not None and len(keys) * self.inner.page_nbytes > CHECK_GROUP_BYTES:
            opened = self._get_overlapped(keys, dst, on_failed)
        elif read is None:
            opened = self._get_whole(keys, dst, on_failed)
        else:
            pieces, check = self._read_plan(keys, dst, on_failed)
            opened = read(keys, pieces, check)
        self._count(opened=opened, seal_failures=failed[0])
        return opened

    def _read_plan(
        self, keys: Sequence[int], dst: list[memoryview], failed: Failed
    ) -> tuple[list[list[memoryview]], Callable[[int], bool]]:
        """Where a get_verified store reads each unit, and the check of each as it lands.
        MAC only: the body straight into the page, the 44-byte tail into its own place (each
        unit one: a store that reads ahead moves them in place); encrypt: the whole value into
        a landing place, decrypted from it into the page: one hot scratch for a store that
        checks each value before reading the next (file), a ring of `reuse_after` for one that
        reads a batch while checking the one before (mooncake: in place, no staging copy)."""
        n, size = len(keys), self.page_nbytes
        if not self.sealer.encrypt:
            tails = self._tails(n)
            pieces = [[d, t.whole] for d, t in zip(dst, tails, strict=False)]
            return pieces, self.sealer.mac_check(keys, dst, tails, size, failed)
        ring = self._landing(getattr(self.inner, "reuse_after", 1))
        at = [ring[i % len(ring)] for i in range(n)]
        pieces, body, tails = [p.value for p in at], [p.body for p in at], [p.tail for p in at]
        return pieces, self.sealer.decrypt_check(keys, body, tails, dst, failed)

    def _get_overlapped(self, keys: Sequence[int], dst: list[memoryview], failed: Failed) -> int:
        """A file store's units read one group after another while the group before is checked
        on the verifier thread; a ring of two groups' tails (MAC only) or scratches (encrypt)
        holds what is read ahead (the store never reads further ahead than that)."""
        assert isinstance(self.inner, FileStore) and self._verifier is not None
        size, n = self.inner.page_nbytes, self.page_nbytes
        group = max(1, CHECK_GROUP_BYTES // size)
        w = 2 * group
        if self.sealer.encrypt:
            ring = memoryview(self._scratch_buf("read-ring", w * size))
            rows = [ring[r * size : (r + 1) * size] for r in range(w)]
            tails = [seal_tail(rows[r][n:]) for r in range(w)]
            pieces = [[rows[i % w]] for i in range(len(keys))]
            body = [rows[i % w][: n + TAG] for i in range(len(keys))]
            check = self.sealer.decrypt_check(
                keys, body, [tails[i % w] for i in range(len(keys))], dst
            )
        else:
            ring = memoryview(self._scratch_buf("tail-ring", w * SEAL_OVERHEAD))
            tails = [seal_tail(ring[r * SEAL_OVERHEAD : (r + 1) * SEAL_OVERHEAD]) for r in range(w)]
            pieces = [[d, tails[i % w].whole] for i, d in enumerate(dst)]
            check = self.sealer.mac_check(keys, dst, [tails[i % w] for i in range(len(keys))], n)
        # the check runs past a miss too (its verdict dropped): failures are counted once,
        # by the store, for the unit that ended the batch
        return self.inner.get_overlapped(
            keys, pieces, Overlap(self._verifier, group, check, failed)
        )

    def _get_whole(self, keys: Sequence[int], dst: list[memoryview], failed: Failed) -> int:
        """Stores that take whole values (mem and any without get_verified): read, open each."""
        stored = [self._scratch_buf(f"whole{i}", self.inner.page_nbytes) for i in range(len(keys))]
        n = self.inner.get(keys, stored)
        opened = 0
        while opened < n and self.sealer.open(
            keys[opened], stored[opened], np.frombuffer(dst[opened], np.uint8)
        ):
            opened += 1
        if opened < n:
            failed(opened)
        return opened

    def _tails(self, n: int) -> list[SealTail]:
        """n tails of this thread, each its own 44 bytes of one array offered to the inner store
        (mooncake moves them in place, none staged). The array grows (doubling) with the
        largest get; a store keeps each array it registered alive, a few small ones at most."""
        tails: list[SealTail] | None = self._scratch.__dict__.get("tails")
        if tails is None or len(tails) < n:
            cap = 1 << max(6, (n - 1).bit_length())
            whole = np.empty(cap * SEAL_OVERHEAD, np.uint8)
            register_host_memory(self.inner, whole)
            view = memoryview(whole)
            tails = [
                seal_tail(view[r * SEAL_OVERHEAD : (r + 1) * SEAL_OVERHEAD]) for r in range(cap)
            ]
            self._scratch.tails = tails
        return tails[:n]

    def _landing(self, count: int) -> list[Landing]:
        """`count` places of one stored value each, this thread's, in one array offered to the
        inner store (count 1: the hot scratch a file store reads into); views made once."""
        size = self.inner.page_nbytes
        ring = self._scratch_buf(f"landing{count}", count * size)
        if count > 1:
            register_host_memory(self.inner, ring)  # once: a registered array is found covered
        made: dict[int, list[Landing]] = self._scratch.__dict__.setdefault("landings", {})
        places = made.get(count)
        if places is None or places[0].value[0].obj is not ring:
            view = memoryview(ring)
            places = made[count] = [
                Landing.at(view[r * size : (r + 1) * size], self.page_nbytes) for r in range(count)
            ]
        return places

    def _scratch_buf(self, name: str, nbytes: int) -> np.ndarray:
        """This thread's buffer `name`, reused across calls: fresh ones would page-fault on
        every use (measured: a third of a get's time for 256 KiB units)."""
        bufs: dict[str, np.ndarray] = self._scratch.__dict__.setdefault("bufs", {})
        buf = bufs.get(name)
        if buf is None or buf.nbytes != nbytes:
            buf = bufs[name] = np.empty(nbytes, np.uint8)
        return buf

    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        return self.put_report(keys, pages).stored

    def put_report(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> PutReport:
        """Seal and store; a store that writes values in pieces (FileStore's write_pieces, a
        Mooncake store's put_pieces) gets the unit's own bytes and a tail (MAC only) or one reused
        ciphertext scratch (encrypt), sealed one unit at a time as it asks for them: no copy, no
        fresh buffer. A file store keeps a unit already stored only if its seal opens (else
        it is rewritten: a unit of another key or a forger's heals at the next backup); the
        other stores overwrite every value they are given."""
        check_batch(keys, pages, "put")
        pairs = [
            (k, page_view(p, self.page_nbytes, "put")) for k, p in zip(keys, pages, strict=True)
        ]
        again = self._forget_failed(keys)
        if again:  # a store that keeps an existing value (mooncake) must not keep these
            self.inner.delete(again)
        self._count(sealed=len(pairs), rewrites=len(again))
        scratch = self._scratch_buf("seal", self.inner.page_nbytes)
        values = (self.sealer.seal_pieces(k, u, scratch) for k, u in pairs)
        if isinstance(self.inner, FileStore):
            report = self.inner.write_pieces(keys, values, self._keep_check(keys))
        elif (write := getattr(self.inner, "put_pieces", None)) is not None:
            stored = write(keys, values)
            report = PutReport(stored, stored * self.inner.page_nbytes)
        else:
            report = put_report(self.inner, keys, [self.sealer.seal(k, u) for k, u in pairs])
        units = report.written_bytes // self.inner.page_nbytes  # the units' bytes, no seal
        return PutReport(report.stored, units * self.page_nbytes)

    def _keep_check(self, keys: Sequence[int]) -> KeepCheck:
        """A unit found stored on write is kept only if it opens (counted like a read's)."""
        stored = self._scratch_buf("kept", self.inner.page_nbytes)
        opened = self._scratch_buf("kept-out", self.page_nbytes)

        def keep(key: int) -> bool:
            ok = self.sealer.open(key, stored, opened)
            self._count(seal_failures=int(not ok))
            return ok

        return KeepCheck([memoryview(stored)], keep)

    def _note_failed(self, key: int) -> None:
        """A unit that failed to open on read: its next write removes it first (a Mooncake
        store refuses to put over a stored value) and counts a rewrite (a file store checks
        and counts its own on the write path)."""
        if isinstance(self.inner, FileStore):
            return
        with self._lock:
            self._failed[key] = None
            if len(self._failed) > _FAILED_KEPT:
                self._failed.popitem(last=False)

    def _forget_failed(self, keys: Sequence[int]) -> list[int]:
        """The keys about to be written that failed to open when last read."""
        with self._lock:
            return [k for k in keys if self._failed.pop(k, 0) is None]

    def delete(self, keys: Sequence[int]) -> int:
        return self.inner.delete(keys)

    def _count(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self.counts[k] += v

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            own = dict(self.counts)
        inner = self.inner.stats()
        return {**inner, **own, "rewrites": own["rewrites"] + inner.get("rewrites", 0)}

    def close(self) -> None:
        if self._verifier is not None:
            self._verifier.shutdown(wait=True)
        self.inner.close()

    def check_integrity(self) -> None:
        assert all(v >= 0 for v in self.counts.values()), self.counts
        self.inner.check_integrity()

"""Units a reader can trust: a keyed MAC (and optionally encryption) over every stored unit.

With a cluster key (StorageConfig.key_file) every unit value is sealed before any backend sees
it, so file, redis, mem and every backend registered later get it alike:
    sealed unit = body | tag (16) | salt (16) | nonce (12)      (SEAL_OVERHEAD = 44 bytes)
    label       = SEAL_TAG | mode | unit key (16, big endian) | unit length (u64)  (LABEL_NBYTES)
    encrypt:  body | tag = AES-256-GCM(plaintext = the unit's bytes, associated data = label)
    MAC only: body = the unit's bytes, tag = AES-256-GCM's tag with associated data = body and
              plaintext = label (its 41 ciphertext bytes are not stored: a reader encrypts the
              label it expects over the body it read and compares tags in constant time).
Either way the tag is GCM's over every stored byte and the label, so a unit rewritten by anyone
without the key, moved under another unit key, cut, or switched between modes fails to open: a
miss, counted as `seal_failures`. The MAC-only layout puts the long part in the associated data
so one AES-GCM call covers a body lying anywhere: a file store reads it straight into the
caller's page (no copy) and the tag is checked right after, while the bytes are in cache.
AES-GCM and not BLAKE2b/HMAC-SHA256: with AES-NI and (V)PCLMULQDQ it is the fastest keyed MAC
hashlib or `cryptography` offers here (measured GMAC 6.4-7.3 GB/s against blake2b 0.2,
sha256 1.0 and Poly1305 2.8-4.4; a streaming GCM context costs 5-7 us to set up, a one-shot
call about 1, so one-shot calls are used throughout).

Nonces never repeat under one AES key: each writer (each Sealer) draws a random 128-bit salt at
start and seals under the key derived from (cluster key, salt) with a counter as nonce. A reader
derives the key of each salt it meets (cached).

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

import hashlib
import hmac
import itertools
import os
import stat
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstrata.storage.base import (
    KeepCheck,
    Overlap,
    PutReport,
    StorageBackend,
    check_batch,
    page_view,
    put_report,
    register_host_memory,
)
from kvstrata.storage.file_store import FileStore

SEAL_TAG = b"kvstrata-seal-v2"  # v2: MAC-only units carry the label as GCM plaintext
NAME_TAG = b"kvstrata-name-v1"
SALT, NONCE, TAG = 16, 12, 16
SEAL_OVERHEAD = TAG + SALT + NONCE
LABEL_NBYTES = len(SEAL_TAG) + 1 + 16 + 8
KEY_MIN_BYTES = 32
_CACHED_KEYS = 4096  # derived AES keys kept per reader (one per writer it has read from)
CHECK_GROUP_BYTES = 1024 * 1024
"""Stored bytes per check task of an overlapped get (a file store reads the next group while
the verifier thread checks this one): enough that a hand-off between threads is small beside
it, few enough that two groups stay in the core's cache."""
_U64 = struct.Struct("<Q")

Failed = Callable[[int], None]
"""Called with i when unit i of a check fails to open (the cold path: counting, healing)."""


@dataclass(frozen=True, slots=True)
class SealTail:
    """Where a stored unit's last 44 bytes (tag | salt | nonce) are read to, and views of its
    parts made once per get, so a check per unit slices and copies nothing."""

    whole: memoryview
    tag: memoryview
    salt: memoryview
    nonce: memoryview


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


def seal_tail(buf: memoryview | None = None) -> SealTail:
    """The parts of `buf` (44 writable bytes; default a fresh buffer) as a SealTail."""
    whole = memoryview(bytearray(SEAL_OVERHEAD)) if buf is None else buf.cast("B")
    if whole.nbytes != SEAL_OVERHEAD:
        raise ValueError(f"a seal tail is {SEAL_OVERHEAD} bytes, got {whole.nbytes}")
    return SealTail(whole, whole[:TAG], whole[TAG : TAG + SALT], whole[TAG + SALT :])


def _ignore(i: int) -> None:
    """For a check whose caller counts its failures itself (an overlapped get, Sealer.open)."""


def read_key_file(path: str | Path) -> bytes:
    """The cluster key in `path` (hex, at least 32 bytes: `kvstrata keys cluster`); ValueError
    naming the file if it is short, not hex, or readable by group or others."""
    p = Path(path)
    mode = p.stat().st_mode  # FileNotFoundError names the file
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"key file {p}: group/others may access it (mode {mode & 0o777:o}); chmod 600"
        )
    try:
        key = bytes.fromhex(p.read_text().strip())
    except ValueError:
        raise ValueError(f"key file {p}: not a hex key (write one with `kvstrata keys`)") from None
    if len(key) < KEY_MIN_BYTES:
        raise ValueError(f"key file {p}: {len(key)} bytes, at least {KEY_MIN_BYTES} needed")
    return key


class Sealer:
    """Seals and opens unit values under one cluster key (see the module docstring)."""

    def __init__(self, key: bytes, encrypt: bool) -> None:
        if len(key) < KEY_MIN_BYTES:
            raise ValueError(f"cluster key must be >= {KEY_MIN_BYTES} bytes, got {len(key)}")
        self.key, self.encrypt = key, encrypt
        self.mode = b"E" if encrypt else b"M"
        self._prefix = SEAL_TAG + self.mode
        self.salt = os.urandom(SALT)
        self.aead = self._derive(self.salt)
        self._nonces = itertools.count(1)
        self._lock = threading.Lock()
        self._keys: OrderedDict[bytes, AESGCM] = OrderedDict()
        self._last = (self.salt, self.aead)  # the salt last met (swapped whole: no lock)

    def name(self, key: int) -> int:
        """Page `key`'s name in a sealed store (128 bits, keyed): its units, commit marker and
        pending record are named from it, so listing the store confirms no page key computed
        from a known prompt, and stores of two keys never share a name."""
        raw = NAME_TAG + key.to_bytes(16, "big")
        digest = hashlib.blake2b(raw, key=self.key[:64], digest_size=16).digest()
        return int.from_bytes(digest, "big")

    def _derive(self, salt: bytes) -> AESGCM:
        return AESGCM(hashlib.blake2b(SEAL_TAG + salt, key=self.key[:64], digest_size=32).digest())

    def _aead_for(self, salt: bytes | memoryview) -> AESGCM:
        """The AES key of a writer's salt: a reader's units mostly come from one writer in a
        row, so the last one met is answered without the lock or the LRU."""
        last = self._last
        if salt == last[0]:
            return last[1]
        if salt == self.salt:
            return self.aead
        salt = bytes(salt)
        with self._lock:
            aead = self._keys.get(salt)
            if aead is None:
                aead = self._keys[salt] = self._derive(salt)
                if len(self._keys) > _CACHED_KEYS:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(salt)
        self._last = (salt, aead)
        return aead

    def _label(self, ukey: int, size: bytes) -> bytes:
        """The label of unit `ukey` whose length is `size` (_U64-packed once per batch)."""
        return self._prefix + ukey.to_bytes(16, "big") + size

    def seal_pieces(self, ukey: int, unit: np.ndarray, scratch: np.ndarray) -> list[memoryview]:
        """The stored value of `unit` (uint8, n bytes) under unit key `ukey` as pieces to store
        one after another (n + 44 bytes in all): MAC only [unit, tag|salt|nonce], nothing
        copied; encrypt [ciphertext|tag in scratch (>= n + 16 bytes, the caller's to reuse
        once stored), salt|nonce]."""
        n, nonce = unit.nbytes, next(self._nonces).to_bytes(NONCE, "little")
        label = self._label(ukey, _U64.pack(n))
        if self.encrypt:
            body = memoryview(scratch[: n + TAG])
            self.aead.encrypt_into(nonce, memoryview(unit), label, body)
            return [body, memoryview(self.salt + nonce)]
        tag = self.aead.encrypt(nonce, label, memoryview(unit))[-TAG:]
        return [memoryview(unit), memoryview(tag + self.salt + nonce)]

    def seal(self, ukey: int, unit: np.ndarray) -> np.ndarray:
        """The stored value of `unit` as one array (for stores that take whole values)."""
        value = np.empty(unit.nbytes + SEAL_OVERHEAD, np.uint8)
        pieces = self.seal_pieces(ukey, unit, value)
        if not self.encrypt:
            value[: unit.nbytes] = unit
        value[-len(pieces[1]) :] = np.frombuffer(pieces[1], np.uint8)
        return value

    def mac_check(
        self,
        keys: Sequence[int],
        bodies: Sequence[memoryview],
        tails: Sequence[SealTail],
        nbytes: int,
        failed: Failed = _ignore,
    ) -> Callable[[int], bool]:
        """MAC only: check(i) says whether bodies[i] (unit i's `nbytes` bytes as read, anywhere
        in memory) and tails[i] are a unit sealed under unit key keys[i]; reads only. Built once
        per get: a unit's check is one GMAC call and a constant-time compare."""
        label, size, aead_for, compare = (
            self._label,
            _U64.pack(nbytes),
            self._aead_for,
            hmac.compare_digest,
        )

        def check(i: int) -> bool:
            t = tails[i]
            want = aead_for(t.salt).encrypt(t.nonce, label(keys[i], size), bodies[i])
            if compare(want[-TAG:], t.tag):
                return True
            failed(i)
            return False

        return check

    def decrypt_check(
        self,
        keys: Sequence[int],
        stored: Sequence[memoryview],
        tails: Sequence[SealTail],
        outs: Sequence[memoryview],
        failed: Failed = _ignore,
    ) -> Callable[[int], bool]:
        """Encrypted: check(i) decrypts stored[i] (unit i's ciphertext | tag, n + 16 bytes) with
        the salt and nonce of tails[i] into outs[i] (n bytes), True if it opens under unit key
        keys[i] (else outs[i] holds no verified bytes: the caller must not use it)."""
        label, aead_for = self._label, self._aead_for
        size = _U64.pack(outs[0].nbytes) if outs else b""

        def check(i: int) -> bool:
            t = tails[i]
            try:
                aead_for(t.salt).decrypt_into(t.nonce, stored[i], label(keys[i], size), outs[i])
            except (InvalidTag, ValueError):
                failed(i)
                return False
            return True

        return check

    def open(self, ukey: int, stored: np.ndarray, out: np.ndarray) -> bool:
        """Verify (and decrypt) a stored value (uint8, n + 44 bytes) into `out` (uint8, the
        unit, n bytes); False if it does not open under this key, unit key and mode (`out` then
        holds no verified bytes: the caller must not use it)."""
        n = out.nbytes
        if stored.nbytes != n + SEAL_OVERHEAD:
            return False
        value = memoryview(stored).cast("B")
        tail = seal_tail(value[n:])
        if not self.encrypt:
            if not self.mac_check([ukey], [value[:n]], [tail], n)(0):
                return False
            out[:] = stored[:n]
            return True
        return self.decrypt_check([ukey], [value[: n + TAG]], [tail], [memoryview(out)])(0)


class SealedStore:
    """A StorageBackend of unit values sealed by `sealer` over `inner` (values 44 bytes longer)."""

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
            if len(self._failed) > _CACHED_KEYS:
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

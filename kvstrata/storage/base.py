"""Storage: the backend protocol, its config, the stored page format and the URL registry.

A backend stores whole pages (numpy uint8 buffers of exactly `page_nbytes`) under 128-bit page
keys. Backends are chosen by URL scheme through `STORAGE_BACKENDS` (`file://DIR` or a plain path
-> file backend, `redis://host:port/db` -> redis, `mooncake://host:rpc_port?metadata=...` -> Mooncake
Store). I/O trouble (lost connection, corrupt or
truncated page) never raises into the serving path: it is a miss or a skipped put, counted in
`stats()`. Bad configuration at construction is a ValueError naming the parameter.

Stored page format (shared by every backend so corruption is detected everywhere):
    header (40 bytes, little endian) + payload (page_nbytes bytes)
    header = magic b"KVSP" | version u16 | header_len u16 | payload_len u64 | xxh3-64(payload) u64
             | page key (16 bytes, big endian)
The key inside the header guards against a page stored under the wrong name.
"""

from __future__ import annotations

import importlib
import operator
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import xxhash

from kvstrata.registry import Registry
from kvstrata.storage.config import StorageConfig

PAGE_MAGIC = b"KVSP"
PAGE_FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHQQ16s")
HEADER_NBYTES = _HEADER.size  # 40
_MASK64 = (1 << 64) - 1


@runtime_checkable
class StorageBackend(Protocol):
    """What the cache manager needs from a store (see docs/CONTRACTS.md)."""

    page_nbytes: int

    def exists_prefix(self, keys: Sequence[int]) -> int:
        """How many leading keys are present (stops at the first absent one)."""
        ...

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        """Read page i into out[i]; returns the leading count read OK (stops at the first miss)."""
        ...

    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        """Store pages; returns how many were stored (failures are counted skips)."""
        ...

    def delete(self, keys: Sequence[int]) -> int:
        """Remove pages; returns how many were present."""
        ...

    def stats(self) -> dict[str, int | float]: ...

    def close(self) -> None: ...

    def check_integrity(self) -> None:
        """Raise AssertionError on broken invariants."""
        ...


BackendFactory = Callable[[str, int, StorageConfig], StorageBackend]
STORAGE_BACKENDS: Registry[StorageBackend] = Registry("storage URL scheme")
# Built-in backends register themselves on import; imported lazily so `base` has no cycles.
_BUILTIN_MODULES = (
    "kvstrata.storage.file_store",
    "kvstrata.storage.redis_store",
    "kvstrata.storage.memory_store",
    "kvstrata.storage.mooncake_store",
)


def exists_runs_beside_io(storage: object) -> bool:
    """Whether the store's `exists_prefix` may run on a thread of its own while a `get`, `put`
    or `delete` runs on another (the storage worker's probe lane: memory.storage_jobs). A
    backend says so with `concurrent_exists = True`; a wrapper answers for what it wraps. A
    client that takes one call at a time (mooncake's) leaves it unset: a probe then waits in
    the worker's queue."""
    return bool(getattr(storage, "concurrent_exists", False))


def reads_run_together(storage: object) -> bool:
    """Whether several `get`s (and `exists_prefix`) may run at once on threads of their own
    (the storage workers: memory.storage_jobs; a write still runs alone). A backend says so with
    `concurrent_reads = True`; a wrapper answers for what it wraps. Mooncake's client (one call
    at a time) and a sealed store (its landing places and check thread are shared) leave it
    unset: their reads run one at a time."""
    return bool(getattr(storage, "concurrent_reads", False))


def register_host_memory(storage: object, array: np.ndarray) -> bool:
    """Offer host memory (a host pool's bytes) to a backend that can move pages in it zero-copy
    (mooncake: registered with its client); False where the backend has no such path."""
    register = getattr(storage, "register_buffer", None)
    return bool(register(array)) if register is not None else False


@dataclass(frozen=True)
class PutReport:
    """What one put did: values stored (written now or found stored and kept) and the payload
    bytes it actually wrote (what counts as moved to storage)."""

    stored: int
    written_bytes: int


def put_report(store: object, keys: Sequence[int], pages: Sequence[np.ndarray]) -> PutReport:
    """Store pages through `store.put_report` where the store keeps values already stored (the
    file store: its report says which it wrote); any other store writes every value it stores."""
    report = getattr(store, "put_report", None)
    if report is not None:
        return report(keys, pages)
    stored = store.put(keys, pages)  # type: ignore[attr-defined]
    return PutReport(stored, stored * (pages[0].nbytes if pages else 0))


@dataclass(frozen=True)
class Overlap:
    """How a get_verified caller overlaps its checks with the reads: the values are checked in
    groups of `group`, one task per group on `executor`, while the next group is read; at most
    two groups are read ahead of the oldest value not yet settled (so values i and i + 2 x group
    may share pieces). `check(i)` must only read (it may run for values past a miss, whose
    verdict is then dropped); `failed(i)` is called once for the value whose check failed and
    ended the batch (what a serial verify counts)."""

    executor: Executor
    group: int
    check: Callable[[int], bool]
    failed: Callable[[int], None]


@dataclass(frozen=True)
class KeepCheck:
    """How a writer decides whether a value already stored under a key is kept or rewritten (a
    sealed store: whether its seal opens): the value is read into `pieces` (page_nbytes in all)
    and `keep(key)` says; a rewrite is counted (`rewrites`)."""

    pieces: Sequence[memoryview]
    keep: Callable[[int], bool]


def url_scheme(url: str) -> str:
    """The scheme of a storage URL; a plain path (no "://") is the file backend."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"storage url must be a non-empty string, got {url!r}")
    if "://" not in url:
        return "file"
    return url.split("://", 1)[0].lower()


def load_backends() -> Registry[StorageBackend]:
    """The registry with every built-in backend registered (the one list of schemes)."""
    for mod in _BUILTIN_MODULES:
        importlib.import_module(mod)
    return STORAGE_BACKENDS


def open_storage(url: str, page_nbytes: int, config: StorageConfig | None = None) -> StorageBackend:
    """Open the backend named by `url`'s scheme (ValueError listing known schemes if unknown)."""
    load_backends()
    factory = STORAGE_BACKENDS.get(url_scheme(url))
    config = config or StorageConfig()
    backend = factory(url, check_page_nbytes(page_nbytes), config)
    if config.emulate_read_s_per_page > 0:
        from kvstrata.storage.latency import SlowReads

        return SlowReads(backend, config.emulate_read_s_per_page)
    return backend


def check_page_nbytes(page_nbytes: int) -> int:
    if (
        isinstance(page_nbytes, bool)
        or not isinstance(page_nbytes, int | np.integer)
        or page_nbytes <= 0
    ):
        raise ValueError(f"page_nbytes must be a positive int, got {page_nbytes!r}")
    return int(page_nbytes)


def page_view(page: np.ndarray, page_nbytes: int, what: str) -> np.ndarray:
    """`page` as a flat uint8 view (no copy); ValueError if it is not one whole page."""
    if (
        not isinstance(page, np.ndarray)
        or page.nbytes != page_nbytes
        or not page.flags.c_contiguous
    ):
        got = f"{type(page).__name__} of {getattr(page, 'nbytes', '?')} bytes"
        raise ValueError(
            f"{what}: each page must be a C-contiguous array of {page_nbytes} bytes, got {got}"
        )
    return page.reshape(-1).view(np.uint8)


def check_batch(keys: Sequence[int], arrays: Sequence[np.ndarray], what: str) -> None:
    if len(keys) != len(arrays):
        raise ValueError(f"{what}: {len(keys)} keys but {len(arrays)} pages")


_NBYTES = operator.attrgetter("nbytes")
Verify = Callable[[int], bool]
"""A get_verified caller's check of value i once its bytes landed (True: keep it)."""


def check_pieces(
    keys: Sequence[int], pieces: Sequence[Sequence[memoryview]], page_nbytes: int
) -> None:
    """A get_verified batch: one list of buffers per key, each list holding page_nbytes."""
    if len(keys) != len(pieces):
        raise ValueError(f"get: {len(keys)} keys but {len(pieces)} pages")
    for p in pieces:
        if sum(map(_NBYTES, p)) != page_nbytes:  # asked per value of every get: no generator
            raise ValueError(f"get_verified: pieces must hold {page_nbytes} bytes")


def checksum(payload: np.ndarray | bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def new_checksum() -> xxhash.xxh3_64:
    """A streaming checksum: update() piece by piece, intdigest() equals checksum(all pieces)."""
    return xxhash.xxh3_64()


def encode_header(key: int, payload: np.ndarray) -> bytes:
    return pack_header(key, payload.nbytes, checksum(payload))


def checksum_of_pieces(pieces: Sequence[memoryview]) -> int:
    """checksum() of the pieces' bytes one after another (no copy joins them)."""
    digest = new_checksum()
    for piece in pieces:
        digest.update(piece)
    return digest.intdigest()


def encode_header_of_pieces(key: int, pieces: Sequence[memoryview]) -> bytes:
    """The header of a payload given as pieces stored one after another (no copy joins them)."""
    return pack_header(key, sum(p.nbytes for p in pieces), checksum_of_pieces(pieces))


def pack_header(key: int, payload_nbytes: int, digest: int) -> bytes:
    return _HEADER.pack(
        PAGE_MAGIC,
        PAGE_FORMAT_VERSION,
        HEADER_NBYTES,
        payload_nbytes,
        digest,
        key.to_bytes(16, "big"),
    )


def header_foreign(header: bytes | bytearray | memoryview, key: int, stored_nbytes: int) -> bool:
    """True if `header` is an intact header of page `key` in another format version or page size
    than the reader's, consistent with the `stored_nbytes` actually stored (header + payload):
    a store of another configuration over the same place (a sealed store's units read without
    the key, or the other way round). That is a miss, never corruption: the value is not removed.
    Call it only where header_ok said no."""
    if len(header) < HEADER_NBYTES:
        return False
    magic, _, hlen, plen, _, kbytes = _HEADER.unpack_from(header)
    return (
        magic == PAGE_MAGIC
        and kbytes == (key & ((1 << 128) - 1)).to_bytes(16, "big")
        and hlen >= HEADER_NBYTES
        and hlen + plen == stored_nbytes
    )


def header_ok(header: bytes | bytearray | memoryview, key: int, page_nbytes: int) -> int | None:
    """The checksum recorded in `header` if it describes page `key` of page_nbytes, else None."""
    if len(header) < HEADER_NBYTES:
        return None
    magic, version, hlen, plen, digest, kbytes = _HEADER.unpack_from(header)
    if (magic, version, hlen, plen) != (
        PAGE_MAGIC,
        PAGE_FORMAT_VERSION,
        HEADER_NBYTES,
        page_nbytes,
    ):
        return None
    if kbytes != (key & ((1 << 128) - 1)).to_bytes(16, "big"):
        return None
    return int(digest)

"""Mooncake Store backend (`mooncake://`): pages in the memory segments of a fleet's clients.

A master places objects across the segments every client contributes (this process's client
contributes `segment` bytes too) and bytes move over TCP (or RDMA). Each value is the stored page
format of `kvstrata.storage.base` (header with length, key and xxh3-64 checksum + payload), under
`prefix` + 32 hex digits, so a corrupt, truncated or foreign value is a miss (and is removed).

Transfers: pages that lie in memory registered with `register_buffer` (a host pool) move
zero-copy: batch_put_from_multi_buffers / batch_get_into_multi_buffers with the header in a
small registered area and the payload straight from / into the page. Other pages go through a
registered staging area of `mooncake_batch_pages` values (one copy) with batch_put_from /
batch_get_into.

Failure model (see mooncake_client): every call is bounded; a dead or unreachable master makes
reads misses and writes counted skips, with one line on stderr, and the client reconnects when
it returns. A value whose segment is gone (its client left) or that Mooncake evicted under memory
pressure is a miss: nothing here assumes a put is durable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstrata.cache.keys import key_hex
from kvstrata.storage.base import (
    HEADER_NBYTES,
    STORAGE_BACKENDS,
    StorageConfig,
    check_batch,
    check_page_nbytes,
    checksum,
    encode_header,
    header_ok,
    page_view,
)
from kvstrata.storage.mooncake_client import RPC_FAIL, MooncakeClient, acquire, release
from kvstrata.storage.mooncake_url import parse_mooncake_url

_KEY_LIMIT = 1 << 128
_COUNTERS = (
    "puts", "put_skipped", "gets", "get_hits", "get_misses", "corrupt", "exists_queries",
    "deleted", "server_errors", "bytes_written", "bytes_read", "zero_copy_pages",
    "staged_pages",
)  # fmt: skip


class MooncakeStore:
    """Storage pages in a Mooncake Store under `prefix` + 32 hex digits."""

    def __init__(self, url: str, page_nbytes: int, config: StorageConfig | None = None) -> None:
        self.page_nbytes = check_page_nbytes(page_nbytes)
        self.config = cfg = config or StorageConfig()
        self.url = url
        self.target = parse_mooncake_url(url)
        self.value_nbytes = HEADER_NBYTES + self.page_nbytes
        self.batch = cfg.mooncake_batch_pages
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self.client: MooncakeClient = acquire(self.target, cfg)
        # staging values and zero-copy headers; only the client's worker thread touches them
        self._stage = np.zeros(self.batch * self.value_nbytes, np.uint8)
        self._headers = np.zeros(self.batch * HEADER_NBYTES, np.uint8)
        self.client.register(self._stage)
        self.client.register(self._headers)
        self._closed = False

    def register_buffer(self, array: np.ndarray) -> bool:
        """Register host memory (a pool's pages) so pages inside it move zero-copy."""
        return self.client.register(array)

    # ---- plumbing ----------------------------------------------------------------------------
    def _name(self, key: int) -> str:
        if not 0 <= key < _KEY_LIMIT:
            raise ValueError(f"page key must be a 128-bit non-negative int, got {key!r}")
        return self.target.prefix + key_hex(key)

    def _count(self, **delta: int) -> None:
        for k, v in delta.items():
            self._counts[k] += v

    def _call(self, what: str, fn: Any) -> list[int] | None:
        """A batched client call; None if it failed (an RPC failure marks the master down)."""
        if self._closed:
            raise RuntimeError(f"mooncake storage {self.url} is closed")
        codes = self.client.call(what, fn)
        if codes is not None and RPC_FAIL in codes:
            self.client.mark_down(f"{what} got RPC_FAIL")
        return codes

    def _zero_copy(self, views: Sequence[np.ndarray]) -> bool:
        return all(self.client.covers(v.ctypes.data, v.nbytes) for v in views)

    def _header_ptr(self, i: int) -> int:
        return self._headers.ctypes.data + i * HEADER_NBYTES

    def _slot(self, i: int) -> np.ndarray:
        return self._stage[i * self.value_nbytes : (i + 1) * self.value_nbytes]

    # ---- queries -----------------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[int]) -> int:
        names = [self._name(k) for k in keys]
        self._count(exists_queries=1)
        if not names:
            return 0
        found = self._call("batch_is_exist", lambda s: s.batch_is_exist(names))
        n = 0
        for flag in found or ():
            if flag != 1:
                break
            n += 1
        return n

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        check_batch(keys, out, "get")
        views = [page_view(o, self.page_nbytes, "get out") for o in out]
        hits = 0
        for lo in range(0, len(keys), self.batch):
            ks, vs = keys[lo : lo + self.batch], views[lo : lo + self.batch]
            got = self._get_batch(ks, vs)
            hits += got
            if got < len(ks):
                break
        self._count(
            gets=1,
            get_hits=hits,
            get_misses=int(hits < len(keys)),
            bytes_read=hits * self.page_nbytes,
        )
        return hits

    def _get_batch(self, keys: Sequence[int], views: list[np.ndarray]) -> int:
        """Read one batch; the leading count that arrived whole and checked."""
        names = [self._name(k) for k in keys]
        direct = self._zero_copy(views)

        def fetch(store: Any) -> list[int]:
            if direct:
                ptrs = [[self._header_ptr(i), v.ctypes.data] for i, v in enumerate(views)]
                sizes = [[HEADER_NBYTES, self.page_nbytes]] * len(views)
                return store.batch_get_into_multi_buffers(names, ptrs, sizes)
            ptrs = [self._slot(i).ctypes.data for i in range(len(names))]
            return store.batch_get_into(names, ptrs, [self.value_nbytes] * len(names))

        sizes_read = self._call("batch_get_into", fetch)
        for i, nread in enumerate(sizes_read or ()):
            if nread != self.value_nbytes or not self._unpack(keys[i], i, views[i], direct):
                return i
        return len(sizes_read or ())

    def _unpack(self, key: int, i: int, view: np.ndarray, direct: bool) -> bool:
        """Check value i (and copy a staged payload out); a corrupt value is removed."""
        if direct:
            header, body = self._headers[i * HEADER_NBYTES : (i + 1) * HEADER_NBYTES], view
        else:
            slot = self._slot(i)
            header, body = slot[:HEADER_NBYTES], slot[HEADER_NBYTES:]
        digest = header_ok(header.tobytes(), key, self.page_nbytes)
        if digest is None or checksum(body) != digest:
            self._count(corrupt=1)
            self.delete([key])
            return False
        if not direct:
            view[:] = body
        self._count(**{"zero_copy_pages" if direct else "staged_pages": 1})
        return True

    # ---- updates -----------------------------------------------------------------------------
    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        check_batch(keys, pages, "put")
        views = [page_view(p, self.page_nbytes, "put") for p in pages]
        stored = 0
        for lo in range(0, len(keys), self.batch):
            stored += self._put_batch(keys[lo : lo + self.batch], views[lo : lo + self.batch])
        self._count(
            puts=stored,
            put_skipped=len(keys) - stored,
            bytes_written=stored * self.value_nbytes,
        )
        return stored

    def _put_batch(self, keys: Sequence[int], views: list[np.ndarray]) -> int:
        names = [self._name(k) for k in keys]
        direct = self._zero_copy(views)

        def send(store: Any) -> list[int]:
            for i, (key, v) in enumerate(zip(keys, views, strict=True)):
                head = np.frombuffer(encode_header(key, v), np.uint8)
                if direct:
                    self._headers[i * HEADER_NBYTES : (i + 1) * HEADER_NBYTES] = head
                else:
                    slot = self._slot(i)
                    slot[:HEADER_NBYTES], slot[HEADER_NBYTES:] = head, v
            if direct:
                ptrs = [[self._header_ptr(i), v.ctypes.data] for i, v in enumerate(views)]
                sizes = [[HEADER_NBYTES, self.page_nbytes]] * len(views)
                return store.batch_put_from_multi_buffers(names, ptrs, sizes)
            ptrs = [self._slot(i).ctypes.data for i in range(len(names))]
            return store.batch_put_from(names, ptrs, [self.value_nbytes] * len(names))

        codes = self._call("batch_put_from", send)
        ok = sum(1 for c in codes or () if c == 0)
        self._count(server_errors=sum(1 for c in codes or () if c not in (0, RPC_FAIL)))
        self._count(**{"zero_copy_pages" if direct else "staged_pages": ok})
        return ok

    def delete(self, keys: Sequence[int]) -> int:
        names = [self._name(k) for k in keys]
        if not names:
            return 0
        codes = self._call("batch_remove", lambda s: s.batch_remove(names, True))
        removed = sum(1 for c in codes or () if c == 0)
        self._count(deleted=removed)
        return removed

    # ---- bookkeeping -------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {**self._counts, **self.client.counts}
        out["down"] = int(self.client.down)
        out["page_nbytes"] = self.page_nbytes
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            release(self.client)

    def check_integrity(self) -> None:
        c = self._counts
        assert all(v >= 0 for v in c.values()), c
        assert c["get_misses"] <= c["gets"], c
        assert self.value_nbytes == HEADER_NBYTES + self.page_nbytes
        assert self._stage.nbytes == self.batch * self.value_nbytes
        self.client.check_integrity()


@STORAGE_BACKENDS.register("mooncake")
def open_mooncake_store(url: str, page_nbytes: int, config: StorageConfig) -> MooncakeStore:
    return MooncakeStore(url, page_nbytes, config)

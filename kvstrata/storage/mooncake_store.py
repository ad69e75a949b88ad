"""Mooncake Store backend (`mooncake://`): pages in the memory segments of a fleet's clients.

A master places objects across the segments its clients contribute: standalone holders
(`mooncake_client`, a node's long-lived memory) in a fleet, so what a serving process wrote
outlives it; a serving process contributes `segment` bytes only when its URL asks (default 0).
Bytes move over TCP (or RDMA). Each value is the stored page
format of `kvstrata.storage.base` (header with length, key and xxh3-64 checksum + payload), under
`prefix` + 32 hex digits, so a corrupt or truncated value is a miss (and is removed).

Transfers (mooncake_pieces): batch_put_from_multi_buffers / batch_get_into_multi_buffers with the
header in a small registered area and each payload piece in place where it lies in memory
registered with `register_buffer` (a host pool, a SealedStore's tails), else through its slot in
a registered staging area (one copy). Payloads may come as pieces (put_pieces, get_verified): a
sealed get moves a unit's body and tail in place, and the seal's tag replaces the xxh3 pass.
A get reads `mooncake_batch_pages` values per transfer, on the client's worker thread, and
checks them on the caller's thread while the worker reads the next batch (the wheel's transfer
holds no GIL): a second core hides the checks (xxh3, or a seal's AES-GCM) behind the reads.
The header and staging areas hold two batches, one per side of that overlap; one get or put
runs at a time per store. A put stages and sends on the worker.

Failure model (see mooncake_client): every call is bounded; a dead or unreachable master makes
reads misses and writes counted skips, with one line on stderr, and the client reconnects when
it returns. A value whose segment is gone (its client left) or that Mooncake evicted under memory
pressure is a miss: nothing here assumes a put is durable. A put the master can place nowhere
(no segment mounted, or all full) is a skip counted in `put_no_space`, with one stderr line
saying to start a holder.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstrata.cache.keys import key_hex
from kvstrata.storage.base import (
    HEADER_NBYTES,
    STORAGE_BACKENDS,
    StorageConfig,
    Verify,
    check_batch,
    check_page_nbytes,
    check_pieces,
    checksum_of_pieces,
    encode_header_of_pieces,
    header_ok,
    page_view,
)
from kvstrata.storage.config import MooncakeStoreConfig
from kvstrata.storage.mooncake_client import (
    NO_SPACE,
    RPC_FAIL,
    MooncakeClient,
    Pending,
    acquire,
    release,
)
from kvstrata.storage.mooncake_pieces import MovePlanner, ValueMove
from kvstrata.storage.mooncake_url import parse_mooncake_url

_KEY_LIMIT = 1 << 128
_COUNTERS = (
    "puts", "put_skipped", "gets", "get_hits", "get_misses", "corrupt", "exists_queries",
    "deleted", "server_errors", "bytes_written", "bytes_read", "zero_copy_pages",
    "staged_pages", "staged_bytes", "put_no_space",
)  # fmt: skip


@dataclass
class BatchOutcome:
    """What one batch did on the client's worker; the caller counts it (stats are its own)."""

    values: int = 0
    """Leading values stored or read whole and checked."""
    zero_copy: int = 0
    """Values whose every byte moved in place (registered memory)."""
    staged: int = 0
    """Values with some piece copied through the staging area."""
    staged_bytes: int = 0
    corrupt: list[int] = field(default_factory=list)
    """Keys whose values failed their header or checksum (removed by the caller)."""
    server_errors: int = 0
    no_space: int = 0
    """Values the master had no segment room for (NO_SPACE)."""
    error: str = ""
    """A caller's mistake found on the worker (raised by the caller as ValueError)."""

    def count(self, move: ValueMove) -> None:
        self.values += 1
        self.staged_bytes += move.staged_nbytes
        if move.zero_copy:
            self.zero_copy += 1
        else:
            self.staged += 1

    def counts(self) -> dict[str, int]:
        return {
            "zero_copy_pages": self.zero_copy,
            "staged_pages": self.staged,
            "staged_bytes": self.staged_bytes,
        }


class MooncakeStore:
    """Storage pages in a Mooncake Store under `prefix` + 32 hex digits."""

    def __init__(
        self, url: str, page_nbytes: int, config: MooncakeStoreConfig | None = None
    ) -> None:
        self.page_nbytes = check_page_nbytes(page_nbytes)
        self.config = cfg = config or MooncakeStoreConfig()
        self.url = url
        self.target = parse_mooncake_url(url)
        self.value_nbytes = HEADER_NBYTES + self.page_nbytes
        self.batch = cfg.mooncake_batch_pages
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self.client: MooncakeClient = acquire(self.target, cfg)
        # staging values and zero-copy headers, two batches' worth: a get reads batch b + 1 into
        # one half while batch b is checked from the other. One get or put at a time (_io).
        self._stage = np.zeros(2 * self.batch * self.value_nbytes, np.uint8)
        self._headers = np.zeros(2 * self.batch * HEADER_NBYTES, np.uint8)
        self._headers_at = int(self._headers.ctypes.data)  # asked per value of every transfer
        self._io = threading.Lock()
        self.client.register(self._stage)
        self.client.register(self._headers)
        self._closed = False

    @property
    def reuse_after(self) -> int:
        """A get_verified buffer given to value i moves in place if it is given again only to
        value i + reuse_after or later (two batches: one read while the other is checked)."""
        return 2 * self.batch

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
        self._check_open()
        return self._marked(what, self.client.call(what, fn))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"mooncake storage {self.url} is closed")

    def _marked(self, what: str, codes: list[int] | None) -> list[int] | None:
        """A call's codes as returned; an RPC failure among them marks the master down."""
        if codes is not None and RPC_FAIL in codes:
            self.client.mark_down(f"{what} got RPC_FAIL")
        return codes

    def _index(self, i: int) -> int:
        """Value i's header and staging slot in a call: batches alternate between the halves."""
        return (i // self.batch) % 2 * self.batch + i % self.batch

    def _header_ptr(self, i: int) -> int:
        return self._headers_at + self._index(i) * HEADER_NBYTES

    def _slot(self, i: int) -> np.ndarray:
        at = self._index(i) * self.value_nbytes
        return self._stage[at : at + self.value_nbytes]

    def _planner(self) -> MovePlanner:
        """Plans one call's moves (value i at its header and slot places)."""
        return MovePlanner(self._header_ptr, self._slot, self.client.covers, self.batch)

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
        pieces = [[memoryview(page_view(o, self.page_nbytes, "get out"))] for o in out]
        return self._get(keys, pieces, None)

    def get_verified(
        self, keys: Sequence[int], pieces: Sequence[Sequence[memoryview]], verify: Verify
    ) -> int:
        """As get, each value read into its `pieces` (lengths summing to page_nbytes; a piece
        in registered memory is read in place, others through the staging slot; a piece may
        serve several values, as a SealedStore's scratch does, each value verified before the
        next is copied into it) and checked by `verify(i)` in place of the xxh3 pass: for a
        caller whose check covers every stored byte (a SealedStore's tag). A False is a miss;
        the value is removed only if its checksum fails too (an intact value is someone
        else's, e.g. sealed under another key: it stays)."""
        check_pieces(keys, pieces, self.page_nbytes)
        return self._get(keys, pieces, verify)

    def _get(
        self, keys: Sequence[int], pieces: Sequence[Sequence[memoryview]], verify: Verify | None
    ) -> int:
        with self._io:
            got = self._read_ahead(keys, pieces, verify)
        self._count(**got.counts(), corrupt=len(got.corrupt))
        if got.corrupt:
            self.delete(got.corrupt)
        hits = got.values
        self._count(
            gets=1,
            get_hits=hits,
            get_misses=int(hits < len(keys)),
            bytes_read=hits * self.page_nbytes,
        )
        return hits

    def _read_ahead(
        self, keys: Sequence[int], pieces: Sequence[Sequence[memoryview]], verify: Verify | None
    ) -> BatchOutcome:
        """Batches of the get read on the worker, batch b + 1 while batch b is checked here
        (the transfer holds no GIL; its headers and staged pieces land in the other half of
        the header and staging areas), each planned while the one before is read. Ends at the
        first value missing or failing its check; a batch read ahead is waited out before
        this returns or raises (its bytes land in the caller's buffers)."""
        spans = [
            range(lo, min(lo + self.batch, len(keys))) for lo in range(0, len(keys), self.batch)
        ]
        planner, got = self._planner(), BatchOutcome()
        moves = planner.plan([pieces[i] for i in spans[0]], 0) if spans else []
        pending = self._fetch(keys, moves, spans[0]) if spans else None
        try:
            for b, span in enumerate(spans):
                later = spans[b + 1] if b + 1 < len(spans) else None
                ahead = planner.plan([pieces[i] for i in later], later.start) if later else []
                sizes, pending = self._landed(pending), None
                if sizes is not None and later is not None:
                    pending = self._fetch(keys, ahead, later)
                if sizes is None or not self._check_span(
                    keys, span, sizes, pieces, moves, verify, got
                ):
                    break
                moves = ahead
        finally:
            if pending is not None:
                self.client.finish(pending)
        return got

    def _landed(self, pending: Pending[list[int]] | None) -> list[int] | None:
        """What each value of a started read returned (None: not started, or it failed)."""
        return (
            None if pending is None else self._marked("batch_get_into", self.client.finish(pending))
        )

    def _fetch(
        self, keys: Sequence[int], moves: Sequence[ValueMove], span: range
    ) -> Pending[list[int]] | None:
        """Start reading values `span` of a get (their `moves`) on the worker (None: not)."""
        self._check_open()
        names = [self._name(keys[i]) for i in span]
        ptrs, sizes = [m.ptrs for m in moves], [m.sizes for m in moves]
        return self.client.start(
            "batch_get_into", lambda s: s.batch_get_into_multi_buffers(names, ptrs, sizes)
        )

    def _check_span(
        self,
        keys: Sequence[int],
        span: range,
        sizes: Sequence[int],
        pieces: Sequence[Sequence[memoryview]],
        moves: Sequence[ValueMove],
        verify: Verify | None,
        got: BatchOutcome,
    ) -> bool:
        """Check values `span` (their `moves`) as read (sizes: what each read returned); True
        if all passed."""
        for i, move, nread in zip(span, moves, sizes, strict=False):
            if nread != self.value_nbytes:
                return False
            verdict = self._check(keys[i], i, move, pieces[i], verify)
            if verdict != "ok":
                got.corrupt += [keys[i]] if verdict == "corrupt" else []
                return False
            got.count(move)
        return len(sizes) == len(span)

    def _check(
        self,
        key: int,
        i: int,
        move: ValueMove,
        pieces: Sequence[memoryview],
        verify: Verify | None,
    ) -> str:
        """Value i as read: "ok", "corrupt" (header or checksum wrong) or "rejected" (the
        caller's check failed on bytes intact under their checksum). Staged pieces copied out."""
        at = self._index(i) * HEADER_NBYTES
        digest = header_ok(self._headers[at : at + HEADER_NBYTES], key, self.page_nbytes)
        if digest is None:
            return "corrupt"
        move.stage_out()
        if verify is None:
            return "ok" if checksum_of_pieces(pieces) == digest else "corrupt"
        if verify(i):
            return "ok"
        return "rejected" if checksum_of_pieces(pieces) == digest else "corrupt"

    # ---- updates -----------------------------------------------------------------------------
    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        check_batch(keys, pages, "put")
        views = [page_view(p, self.page_nbytes, "put") for p in pages]
        return self.put_pieces(keys, [[memoryview(v)] for v in views])

    def put_pieces(self, keys: Sequence[int], values: Iterable[Sequence[memoryview]]) -> int:
        """As put, each payload given as pieces stored one after another (lengths summing to
        page_nbytes). `values` is taken in order on the client's worker, each staged before the
        next is taken, so a producer may reuse an unregistered buffer (a SealedStore's scratch);
        pieces in registered memory move in place when their batch is sent, so those must not
        change before put_pieces returns. A batch not sent (master down) ends the call."""
        taken = iter(values)
        stored = 0
        with self._io:
            for lo in range(0, len(keys), self.batch):
                part = keys[lo : lo + self.batch]
                got = self._put_batch(part, taken)
                if got is None:
                    break
                stored += got
        self._count(
            puts=stored,
            put_skipped=len(keys) - stored,
            bytes_written=stored * self.value_nbytes,
        )
        return stored

    def _put_batch(self, keys: Sequence[int], values: Iterator[Sequence[memoryview]]) -> int | None:
        """Stage and send one batch on the worker; values stored, None if it was not sent."""
        names = [self._name(k) for k in keys]
        sent = BatchOutcome()

        def send(store: Any) -> list[int]:
            moves, planner = [], self._planner()
            for i, key in enumerate(keys):  # each value staged before the next is taken
                value = list(next(values))
                if sum(p.nbytes for p in value) != self.page_nbytes:
                    sent.error = f"put: each page must hold {self.page_nbytes} bytes"
                    return []
                move = planner.plan([value], i)[0]
                head = np.frombuffer(encode_header_of_pieces(key, value), np.uint8)
                self._headers[i * HEADER_NBYTES : (i + 1) * HEADER_NBYTES] = (
                    head  # i < batch: half 0
                )
                move.stage_in()
                moves.append(move)
            codes = store.batch_put_from_multi_buffers(
                names, [m.ptrs for m in moves], [m.sizes for m in moves]
            )
            for code, move in zip(codes, moves, strict=False):
                if code == 0:
                    sent.count(move)
            sent.server_errors = sum(1 for c in codes if c not in (0, RPC_FAIL))
            sent.no_space = sum(1 for c in codes if c == NO_SPACE)
            return codes

        codes = self._call("batch_put_from", send)
        if sent.error:
            raise ValueError(sent.error)
        self._count(**sent.counts(), server_errors=sent.server_errors, put_no_space=sent.no_space)
        if sent.no_space:
            self.client.warn_no_space()
        return None if codes is None else sent.values

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
        assert self._stage.nbytes == 2 * self.batch * self.value_nbytes
        self.client.check_integrity()


@STORAGE_BACKENDS.register("mooncake")
def open_mooncake_store(url: str, page_nbytes: int, config: StorageConfig) -> MooncakeStore:
    return MooncakeStore(url, page_nbytes, config.mooncake)

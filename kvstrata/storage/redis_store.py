"""Redis/Valkey backend: pages shared by many workers on many machines.

Every value is the stored page format of `kvstrata.storage.base` (header with length, key and
xxh3-64 checksum + payload), so a corrupt value is detected, is a miss and is removed; a value
whose intact header names another page size or format (a sealed store's units read without the
key) is a miss that stays (counted `foreign`). Batches go
in pipelined round trips of `redis_batch_pages` pages (STRLEN for exists_prefix, MGET for get,
SET for put).

Failure model: after construction no I/O error reaches the caller. A connection error marks the
server down for a backoff (doubling from `reconnect_backoff_s` up to `reconnect_backoff_max_s`);
while down, calls return misses / 0 at once and count the skipped work in stats; the first call
after the backoff tries again and redis-py reconnects on its own. Sockets have short timeouts and
redis-py's internal retries are off, so a dead server costs one timeout per backoff period at
most. Size limits and LRU are the server's job (maxmemory + maxmemory-policy allkeys-lru).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstrata.cache.keys import key_hex
from kvstrata.storage.base import (
    HEADER_NBYTES,
    STORAGE_BACKENDS,
    StorageConfig,
    Verify,
    check_batch,
    check_page_nbytes,
    check_pieces,
    checksum,
    encode_header,
    header_foreign,
    header_ok,
    page_view,
)
from kvstrata.storage.config import RedisStoreConfig

T = TypeVar("T")
_KEY_LIMIT = 1 << 128
_COUNTERS = (
    "puts", "put_skipped", "gets", "get_hits", "get_misses", "corrupt", "exists_queries",
    "deleted", "connection_errors", "server_errors", "calls_skipped_down", "reconnects",
    "bytes_written", "bytes_read", "foreign",
)  # fmt: skip


class RedisStore:
    """Storage pages in a Redis (or Valkey) server under `redis_key_prefix` + 32 hex digits."""

    concurrent_exists = True  # each call takes its own connection from the client's pool
    concurrent_reads = True

    def __init__(self, url: str, page_nbytes: int, config: RedisStoreConfig | None = None) -> None:
        self.page_nbytes = check_page_nbytes(page_nbytes)
        self.config = cfg = config or RedisStoreConfig()
        self.url = url
        self.value_nbytes = HEADER_NBYTES + self.page_nbytes
        self._prefix = cfg.redis_key_prefix.encode()
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=cfg.socket_timeout_s,
                socket_connect_timeout=cfg.connect_timeout_s,
                retry=Retry(NoBackoff(), 0),  # we own the retry policy (backoff below)
                health_check_interval=0,
            )
        except (ValueError, redis.RedisError) as e:
            raise ValueError(f"storage url {url!r} is not a valid redis URL: {e}") from None
        self._lock = threading.Lock()  # guards counters and the down state (threads only)
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._down_until = 0.0
        self._backoff = cfg.reconnect_backoff_s
        self._failed = False
        self._closed = False
        if cfg.require_reachable_at_start:
            try:
                self._client.ping()
            except (redis.RedisError, OSError) as e:
                self._client.close()
                raise ValueError(
                    f"storage url {url!r}: redis server is unreachable ({e})"
                ) from None

    # ---- plumbing ----------------------------------------------------------------------------
    def _name(self, key: int) -> bytes:
        if not 0 <= key < _KEY_LIMIT:
            raise ValueError(f"page key must be a 128-bit non-negative int, got {key!r}")
        return self._prefix + key_hex(key).encode()

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, v in counts.items():
                self._counts[name] += v

    def _guarded(self, fn: Callable[[], T]) -> T | None:
        """Run one round trip; None (counted) if the server is down or the call failed."""
        if self._closed:
            raise RuntimeError(f"redis storage {self.url} is closed")
        if time.monotonic() < self._down_until:
            self._count(calls_skipped_down=1)
            return None
        try:
            result = fn()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._mark_down()
            return None
        except redis.RedisError:
            self._count(server_errors=1)  # e.g. OOM under maxmemory: a skip, the link is fine
            return None
        if self._failed:
            with self._lock:
                self._failed = False
                self._backoff = self.config.reconnect_backoff_s
                self._counts["reconnects"] += 1
        return result

    def _mark_down(self) -> None:
        with self._lock:
            self._counts["connection_errors"] += 1
            self._failed = True
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.config.reconnect_backoff_max_s)
        try:
            self._client.connection_pool.disconnect()  # drop half-dead sockets; next call reconnects
        except Exception:  # noqa: BLE001 - best effort on an already broken link
            pass

    def _chunks(self, n: int) -> range:
        return range(0, n, self.config.redis_batch_pages)

    # ---- queries -----------------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[int]) -> int:
        names = [self._name(k) for k in keys]
        self._count(exists_queries=1)
        n = 0
        for lo in self._chunks(len(names)):
            part = names[lo : lo + self.config.redis_batch_pages]
            lens = self._guarded(lambda part=part: self._pipelined("strlen", part))
            if lens is None:
                return n
            for length in lens:
                if length != self.value_nbytes:
                    return n
                n += 1
        return n

    def _pipelined(self, command: str, names: list[bytes]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            getattr(pipe, command)(name)
        return pipe.execute()

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        check_batch(keys, out, "get")
        views = [page_view(o, self.page_nbytes, "get out") for o in out]
        return self._get(keys, [[memoryview(v)] for v in views], None)

    def get_verified(
        self, keys: Sequence[int], pieces: Sequence[Sequence[memoryview]], verify: Verify
    ) -> int:
        """As get, each payload copied into its `pieces` (lengths summing to page_nbytes; later
        values may reuse a piece once verify returned) and checked by `verify(i)` in place of
        the xxh3 pass (a SealedStore's tag); a False is a miss, and the value is removed only
        if its checksum fails too (see FileStore.get_verified)."""
        check_pieces(keys, pieces, self.page_nbytes)
        return self._get(keys, pieces, verify)

    def _get(
        self, keys: Sequence[int], pieces: Sequence[Sequence[memoryview]], verify: Verify | None
    ) -> int:
        names = [self._name(k) for k in keys]
        hits = 0
        for lo in self._chunks(len(names)):
            part = names[lo : lo + self.config.redis_batch_pages]
            values = self._guarded(lambda part=part: self._client.mget(part))
            if values is None:
                break
            got = self._unpack(keys, pieces, lo, values, verify)
            hits += got
            if got < len(part):
                break
        self._count(
            gets=1,
            get_hits=hits,
            get_misses=int(hits < len(names)),
            bytes_read=hits * self.page_nbytes,
        )
        return hits

    def _unpack(
        self,
        keys: Sequence[int],
        pieces: Sequence[Sequence[memoryview]],
        lo: int,
        values: list[Any],
        verify: Verify | None,
    ) -> int:
        """Check and copy values into pieces[lo:]; returns the leading count that was valid."""
        for i, value in enumerate(values):
            key = keys[lo + i]
            if value is None:
                return i
            check = None if verify is None else (lambda j=lo + i: verify(j))
            outcome = self._take(key, value, pieces[lo + i], check)
            if outcome == "ok":
                continue
            if outcome == "corrupt":
                self._guarded(lambda key=key: self._client.delete(self._name(key)))
            if outcome in ("corrupt", "foreign"):
                self._count(**{outcome: 1})
            return i
        return len(values)

    def _take(
        self, key: int, value: bytes, dst: Sequence[memoryview], check: Callable[[], bool] | None
    ) -> str:
        """Copy one value's payload into dst: "ok", "corrupt", "foreign" (an intact header of
        another size or format) or "rejected" (the caller's check failed, the checksum holds)."""
        digest = (
            header_ok(value, key, self.page_nbytes) if len(value) == self.value_nbytes else None
        )
        if digest is None:
            return "foreign" if header_foreign(value, key, len(value)) else "corrupt"
        body = memoryview(value)[HEADER_NBYTES:]
        if check is None and checksum(body) != digest:
            return "corrupt"
        at = 0
        for piece in dst:
            piece[:] = body[at : at + piece.nbytes]
            at += piece.nbytes
        if check is None or check():
            return "ok"
        return "rejected" if checksum(body) == digest else "corrupt"

    # ---- updates -----------------------------------------------------------------------------
    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        check_batch(keys, pages, "put")
        views = [page_view(p, self.page_nbytes, "put") for p in pages]
        names = [self._name(k) for k in keys]
        stored = 0
        for lo in self._chunks(len(names)):
            hi = lo + self.config.redis_batch_pages
            results = self._guarded(
                lambda lo=lo, hi=hi: self._set_batch(keys[lo:hi], names[lo:hi], views[lo:hi])
            )
            for r in results or ():
                stored += r is True
                if isinstance(r, redis.RedisError):  # e.g. OOM under maxmemory noeviction
                    self._count(server_errors=1)
        self._count(
            puts=stored, put_skipped=len(names) - stored, bytes_written=stored * self.value_nbytes
        )
        if stored < len(names):
            self._warn_once(len(names) - stored)
        return stored

    def _warn_once(self, skipped: int) -> None:
        """The first failed write says so on stderr; later ones are only counted."""
        if getattr(self, "_warned", False):
            return
        self._warned = True
        with self._lock:
            why = "server unreachable" if self._failed else "server refused (e.g. maxmemory)"
        print(
            f"kvstrata: warning: storage write to {self.url} failed ({why}): {skipped} page(s) not "
            "stored; further failures only counted in put_skipped",
            file=sys.stderr,
        )

    def _set_batch(
        self, keys: Sequence[int], names: list[bytes], views: list[np.ndarray]
    ) -> list[Any]:
        ttl = self.config.redis_ttl_s or None
        pipe = self._client.pipeline(transaction=False)
        for key, name, view in zip(keys, names, views, strict=True):
            pipe.set(name, b"".join((encode_header(key, view), view)), ex=ttl)
        return pipe.execute(raise_on_error=False)

    def set_expiry(self, keys: Sequence[int], ttl_s: int) -> int:
        """Give stored `keys` an expiry of ttl_s seconds (0 = none); how many changed."""
        names = [self._name(k) for k in keys]
        done = 0
        for lo in self._chunks(len(names)):
            part = names[lo : lo + self.config.redis_batch_pages]

            def batch(part: list[bytes] = part) -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for name in part:
                    pipe.expire(name, ttl_s) if ttl_s else pipe.persist(name)
                return pipe.execute(raise_on_error=False)

            done += sum(1 for r in self._guarded(batch) or () if r is True)
        return done

    def delete(self, keys: Sequence[int]) -> int:
        names = [self._name(k) for k in keys]
        removed = self._guarded(lambda: self._client.delete(*names)) if names else 0
        self._count(deleted=int(removed or 0))
        return int(removed or 0)

    # ---- bookkeeping -------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = dict(self._counts)
            out["down"] = int(time.monotonic() < self._down_until)
        out["page_nbytes"] = self.page_nbytes
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    def check_integrity(self) -> None:
        with self._lock:
            c = dict(self._counts)
            assert all(v >= 0 for v in c.values()), c
            assert c["get_misses"] <= c["gets"], c
            assert (
                self.config.reconnect_backoff_s
                <= self._backoff
                <= self.config.reconnect_backoff_max_s
            )
        assert self.value_nbytes == HEADER_NBYTES + self.page_nbytes


@STORAGE_BACKENDS.register("redis")
def open_redis_store(url: str, page_nbytes: int, config: StorageConfig) -> RedisStore:
    return RedisStore(url, page_nbytes, config.redis)


@STORAGE_BACKENDS.register("rediss")
def open_rediss_store(url: str, page_nbytes: int, config: StorageConfig) -> RedisStore:
    return RedisStore(url, page_nbytes, config.redis)

"""One Mooncake Store client per process and master, with every call bounded in time.

The `MooncakeDistributedStore` calls of the wheel block in C++ (its `setup` waits minutes on an
unreachable master), so each call runs on one daemon worker thread and the caller waits at most
`MooncakeStoreConfig.mooncake_timeout_s` (`mooncake_setup_timeout_s` for the set-up). The set-up holds
the GIL while it retries, so it is only tried once the master's RPC port and the metadata server
accept a TCP connection (within `connect_timeout_s`). A call that
outlives its bound, raises, or reports an RPC failure marks the master down: for a backoff
(doubling from `reconnect_backoff_s` up to `reconnect_backoff_max_s`) calls return None at once
and are counted; the first call after it tries again (the wheel's client reconnects by itself,
and a failed set-up is retried). A worker still stuck in an old call also makes calls return
None. The first failure prints one line on stderr naming the call that failed.

The wheel's client does not survive fork: once one was set up in a process, a child forked from
it hangs in its own set-up. `used_in_this_process()` tells launchers to spawn instead, and a
forked child that tries anyway gets a ValueError saying so (never a hang).

Clients are shared per process by target (everything in the URL but the key prefix): a unit
store and its commit store are one client contributing one segment. `acquire` / `release`
count the users; the last release closes the client.
"""

from __future__ import annotations

import bisect
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import numpy as np

from kvstrata.storage.config import MooncakeStoreConfig
from kvstrata.storage.mooncake_url import MooncakeTarget

T = TypeVar("T")
RPC_FAIL = -900  # the wheel's ErrorCode for a failed master RPC
NO_SPACE = -200  # the wheel's NO_AVAILABLE_HANDLE: no mounted segment had room for the value
_COUNTERS = ("connection_errors", "timeouts", "calls_skipped_down", "reconnects", "setups")


class _Worker:
    """One daemon thread running submitted calls in order (a stuck call never blocks exit)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                    fut.set_exception(e)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)


def _import_store_class() -> Any:
    # the wheel's C++ logger reads MC_LOG_LEVEL when it loads: errors only unless the user says
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ValueError(
            f"mooncake storage needs the mooncake extra (pip mooncake-transfer-engine-non-cuda, "
            f"installed by scripts/setup_env.sh) and Debian's libibverbs1/libnuma1/libcurl4: {e}"
        ) from None
    return MooncakeDistributedStore


@dataclass(frozen=True)
class Pending(Generic[T]):
    """A call started on the worker (MooncakeClient.start), to be finished."""

    what: str
    """The call's name, for the line a timeout or failure prints."""
    future: Future[T]


class MooncakeClient:
    """A set-up MooncakeDistributedStore behind a bounded, fail-soft `call`."""

    def __init__(self, target: MooncakeTarget, config: MooncakeStoreConfig) -> None:
        self.target, self.config = target, config
        self._store_class = _import_store_class()
        self.store: Any = None  # a fresh wheel client per set-up try (a failed one is dropped)
        self.users = 0
        self._worker = _Worker(f"mooncake-{target.master}")
        self._busy: Future[Any] | None = None
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(_COUNTERS, 0)
        self._ready = False
        self._failed = False
        self._warned = False
        self._warned_no_space = False
        self._down_until = 0.0
        self._backoff = config.reconnect_backoff_s
        self._regions: list[tuple[int, int, np.ndarray]] = []  # (start, end, array kept alive)
        # (starts, ends) of _regions sorted by start, swapped whole (read without the lock)
        self._bounds: tuple[list[int], list[int]] = ([], [])
        self._closed = False
        self.last_error = ""

    # ---- set-up and bounded calls ----------------------------------------------------------
    def setup(self) -> bool:
        """Join the master (bounded); False (and down for a backoff) if it did not answer."""
        t = self.target
        self._count(setups=1)
        unreachable = self._unreachable()
        if unreachable:  # the wheel's set-up holds the GIL for seconds on a dead master
            self.last_error = unreachable
            self.mark_down(unreachable)
            return False
        self.store = self._store_class()
        rc = self._bounded(
            "setup",
            lambda: self.store.setup(
                t.local_host,
                t.metadata,
                t.segment_bytes,
                t.buffer_bytes,
                t.protocol,
                t.device,
                t.master,
            ),  # fmt: skip
            self.config.mooncake_setup_timeout_s,
        )
        if rc != 0:
            if rc is not None:
                self.last_error = f"setup returned {rc}"
                self.mark_down(self.last_error)
            return False
        self._ready = True
        for start, end, _ in self._regions:  # registered before the client was up
            self._bounded(
                "register_buffer",
                lambda s=start, e=end: self.store.register_buffer(s, e - s),
                self.config.mooncake_timeout_s,
            )
        return True

    def _unreachable(self) -> str:
        """Why the master's RPC port or the metadata server refuses a TCP connection ("" = ok)."""
        meta = urlsplit(self.target.metadata)
        ends = [("master", self.target.master)]
        if meta.scheme in ("http", "https") and meta.hostname:
            ends.append(("metadata server", f"{meta.hostname}:{meta.port or 80}"))
        for what, end in ends:
            host, port = end.rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), self.config.connect_timeout_s).close()
            except OSError as e:
                return f"{what} {end} unreachable: {e}"
        return ""

    def call(self, what: str, fn: Callable[[Any], T]) -> T | None:
        """fn(store) on the worker, bounded; None (counted) when down, stuck, timed out or raised."""
        pending = self.start(what, fn)
        return None if pending is None else self.finish(pending)

    def start(self, what: str, fn: Callable[[Any], T]) -> Pending[T] | None:
        """fn(store) submitted to the worker, not waited for (a caller checks what the call
        before read meanwhile); None (counted) when down or a call is still in flight. Every
        started call must be finished, its bytes landed, before its buffers are reused."""
        if self._closed:
            raise RuntimeError(f"mooncake storage client for {self.target.master} is closed")
        if time.monotonic() < self._down_until or (self._busy and not self._busy.done()):
            self._count(calls_skipped_down=1)
            return None
        if not self._ready and not self.setup():
            return None
        self._busy = fut = self._worker.submit(lambda: fn(self.store))
        return Pending(what, fut)

    def finish(self, pending: Pending[T]) -> T | None:
        """The started call's result, waited for at most mooncake_timeout_s; None as call's."""
        result = self._wait(pending.what, pending.future, self.config.mooncake_timeout_s)
        if result is not None:
            self.mark_up()
        return result

    def _bounded(self, what: str, fn: Callable[[], T], timeout: float) -> T | None:
        self._busy = fut = self._worker.submit(fn)
        return self._wait(what, fut, timeout)

    def _wait(self, what: str, fut: Future[T], timeout: float) -> T | None:
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            self._count(timeouts=1)
            self.last_error = f"{what} did not return within {timeout}s"
            self.mark_down(self.last_error)
        except Exception as e:  # noqa: BLE001 - the wheel raises RuntimeError and others
            self.last_error = f"{what} raised {type(e).__name__}: {e}"
            self.mark_down(self.last_error)
        return None

    def mark_down(self, why: str) -> None:
        """The master failed us: calls return None until the backoff passes; one stderr line."""
        with self._lock:
            self.counts["connection_errors"] += 1
            self._failed = True
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.config.reconnect_backoff_max_s)
            first, self._warned = not self._warned, True
        if first:
            print(
                f"kvstrata: warning: mooncake master {self.target.master} failed ({why}); storage "
                "reads are misses and backups skipped until it answers again (counted in stats)",
                file=sys.stderr,
            )

    def warn_no_space(self) -> None:
        """A put the master could place nowhere: one stderr line saying who must contribute memory
        (serving processes contribute none by default; holders do)."""
        with self._lock:
            first, self._warned_no_space = not self._warned_no_space, True
        if first:
            t = self.target
            print(
                f"kvstrata: warning: mooncake master {t.master} had no room for a put "
                "(NO_AVAILABLE_HANDLE): no segment is mounted or all are full. Start a holder "
                f"(mooncake_client --global_segment_size=4GB --master_server_address={t.master} "
                f"--metadata_server={t.metadata}) or give this process segment=BYTES in its URL; "
                "such puts are skipped and counted (put_no_space)",
                file=sys.stderr,
            )

    def mark_up(self) -> None:
        if self._failed:
            with self._lock:
                self._failed = False
                self._backoff = self.config.reconnect_backoff_s
                self.counts["reconnects"] += 1

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def _count(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self.counts[k] += v

    # ---- registered memory (zero-copy transfers) -------------------------------------------
    def register(self, array: np.ndarray) -> bool:
        """Register `array`'s memory for batch_put_from / batch_get_into; True if registered."""
        start = array.ctypes.data
        end = start + array.nbytes
        if self.covers(start, array.nbytes):
            return True
        self._regions.append((start, end, array))
        self._index_regions()
        if not self._ready:
            return True  # registered at set-up
        rc = self._bounded(
            "register_buffer",
            lambda: self.store.register_buffer(start, array.nbytes),
            self.config.mooncake_timeout_s,
        )
        if rc != 0:
            self._regions.pop()
            self._index_regions()
            return False
        return True

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, ptr + nbytes) lies inside one registered region (asked per piece of
        every transfer: a bisect over the sorted, disjoint regions)."""
        starts, ends = self._bounds
        at = bisect.bisect_right(starts, ptr) - 1
        return at >= 0 and ptr + nbytes <= ends[at]

    def _index_regions(self) -> None:
        spans = sorted((s, e) for s, e, _ in self._regions)
        self._bounds = ([s for s, _ in spans], [e for _, e in spans])

    def unregister_all(self) -> None:
        for start, _, _ in self._regions:
            if self._ready:
                self._bounded(
                    "unregister_buffer", lambda s=start: self.store.unregister_buffer(s), 2.0
                )
        self._regions.clear()
        self._index_regions()

    def close(self) -> None:
        if self._closed:
            return
        if self._ready and not (self._busy and not self._busy.done()):
            self.unregister_all()
            # leaving unmounts the segment at the master: bounded like joining
            self._bounded("close", self.store.close, self.config.mooncake_setup_timeout_s)
        self._closed = True
        self._worker.stop()

    def check_integrity(self) -> None:
        with self._lock:
            assert all(v >= 0 for v in self.counts.values()), self.counts
            assert (
                self.config.reconnect_backoff_s
                <= self._backoff
                <= self.config.reconnect_backoff_max_s
            )
        spans = sorted((s, e) for s, e, _ in self._regions)
        assert self._bounds == ([s for s, _ in spans], [e for _, e in spans]), spans
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
        assert self.users >= 0


_SHARED: dict[tuple[Any, ...], MooncakeClient] = {}
_SHARED_LOCK = threading.Lock()
_SET_UP_IN_PID = 0  # the process that set up a wheel client (inherited by forked children)


def used_in_this_process() -> bool:
    """A Mooncake client was set up here (or in the parent this process was forked from)."""
    return _SET_UP_IN_PID != 0


def _refuse_after_fork(target: MooncakeTarget) -> None:
    if _SET_UP_IN_PID not in (0, os.getpid()):
        raise ValueError(
            f"mooncake storage {target.master}: this process was forked from one that used a "
            "Mooncake client, which does not survive fork; start such processes with spawn"
        )


def acquire(target: MooncakeTarget, config: MooncakeStoreConfig) -> MooncakeClient:
    """The process's client for `target` (set up now if it is new)."""
    global _SET_UP_IN_PID
    with _SHARED_LOCK:
        _refuse_after_fork(target)
        client = _SHARED.get(target.client_id)
        if client is None or client._closed:
            _SET_UP_IN_PID = os.getpid()
            client = MooncakeClient(target, config)
            if not client.setup() and config.require_reachable_at_start:
                client.close()
                raise ValueError(
                    f"mooncake master {target.master} (metadata {target.metadata}) is unreachable "
                    f"or refused this client ({client.last_error})"
                )
            _SHARED[target.client_id] = client
        client.users += 1
        return client


def release(client: MooncakeClient) -> None:
    """One user fewer; the last one closes the client."""
    with _SHARED_LOCK:
        client.users -= 1
        if client.users == 0:
            _SHARED.pop(client.target.client_id, None)
            client.close()

"""One replica's KV event stream into the fleet index: a thread with a SUB and a replay DEALER.

On start the thread subscribes, then asks the replica's replay socket for every batch it still
buffers (from sequence 0) and applies them in order; live batches then follow, each applied once
(sequence numbers below the next expected are the overlap with the replay, skipped). A sequence
gap (a batch the SUB dropped) is filled from the replay socket. A publisher that restarted (ZMQ
reconnects by itself) starts again at 0: a batch whose sequence number was seen before with other
bytes means exactly that, and the replica's entries are rebuilt from its replay. A message that
fails to decode or apply is counted and skipped: one bad message never stops the thread.

A replay is whole or failed (kvstrata/router/replay_client.py: no end marker within the wait, or
batches missing from the answer). The batches it did bring are kept (a prefix, in order); the
thread asks again from the next one after a pause that doubles per failure in a row
(ReplayTiming), meanwhile reading the live stream (a batch that follows on is applied, one past
a gap waits for the replay) and the index counts the replica's holdings as unknown
(FleetIndex.set_whole) until a replay completes. A retry that finds the replica's buffer no
longer holds what is missing rebuilds the replica's entries from its whole buffer.

Payloads of either format (kvstrata.cache.event_wire). With the replica's event sockets under
CURVE, both sockets here are CURVE clients with the router's key pair, trusting the replica's
server key only if it is in the router's peers directory (kvstrata.zmq_curve).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import xxhash
import zmq

from kvstrata.cache.event_wire import decode_batch
from kvstrata.router.index import FleetIndex
from kvstrata.router.metrics import FleetMetrics
from kvstrata.router.replay_client import ReplayTiming, replayed
from kvstrata.zmq_curve import CurveKeys

POLL_MS = 100  # how often the thread looks at its stop flag (and at an owed replay's retry)
SEEN = 4096  # recent (seq -> payload digest) kept to tell an overlap from a restarted publisher


@dataclass(frozen=True)
class EventSource:
    """Where one replica publishes (from its /v1/kv/events/info, hosts made connectable)."""

    replica: str  # its base URL (the index's name for it)
    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    curve_server_key: bytes | None  # z85; None: the sockets are not CURVE servers
    storage: str  # the shared store it reads ("" none)


def connectable(endpoint: str, replica_url: str) -> str:
    """`tcp://*:P` / `tcp://0.0.0.0:P` (what a server binds) as an address to connect to: the
    replica's own host."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::"):
        host = urlsplit(replica_url).hostname or "127.0.0.1"
    return f"tcp://{host}:{port}"


class BufferRolled(Exception):
    """A replay's answer starts past the batch asked for: the replica no longer buffers it."""


class Subscriber(threading.Thread):
    def __init__(
        self,
        src: EventSource,
        index: FleetIndex,
        metrics: FleetMetrics,
        keys: CurveKeys | None,
        timing: ReplayTiming | None = None,
    ) -> None:
        super().__init__(name=f"kv-events {src.replica}", daemon=True)
        if src.curve_server_key is not None and keys is None:
            raise ValueError(
                f"replica {src.replica}: its KV events use CURVE; give the router "
                "--router-kv-events-curve-secret-file and --router-kv-events-curve-peers-dir"
            )
        self.src, self.index, self.metrics, self.keys = src, index, metrics, keys
        self.timing = timing or ReplayTiming()
        self.ctx = zmq.Context()
        self.next = 0  # the sequence number expected next
        self.owed = False  # the last replay failed: batches from `next` on are still to come
        self.failures = 0  # replays failed in a row
        self.retry_at = 0.0  # monotonic time of the owed replay's next try
        self.seen: OrderedDict[int, int] = OrderedDict()  # seq -> xxh64 of its payload
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    # ---- the thread -------------------------------------------------------------------------------
    def run(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.src.topic)
        sub.connect(self.src.endpoint)
        try:
            self._guarded(lambda: self._replay(0))
            while not self._halt.is_set():
                if self.owed and time.monotonic() >= self.retry_at:
                    self._guarded(lambda: self._replay(self.next))
                if sub.poll(POLL_MS):
                    self._on_message(sub.recv_multipart())
        finally:
            sub.close()
            self.ctx.term()

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.src.curve_server_key is not None:
            assert self.keys is not None
            self.keys.client(sock, self.src.curve_server_key)
        return sock

    def _on_message(self, frames: list[bytes]) -> None:
        def take() -> None:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError(f"{len(frames)} frames, not (topic, seq, payload)")
            self._take(int.from_bytes(frames[1], "big"), frames[2], live=True)

        self._guarded(take)

    def _guarded(self, work: Callable[[], None]) -> None:
        """Run `work`; a failure is counted by kind and the stream goes on."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - one bad message never stops the thread
            kind = type(exc).__name__
            self.metrics.event_failures.labels(replica=self.src.replica, kind=kind).inc()

    def _take(self, seq: int, payload: bytes, live: bool) -> None:
        """Apply batch `seq` once, in order (a gap filled from the replay socket first)."""
        digest = xxhash.xxh64_intdigest(payload)
        if seq < self.next:
            if self.seen.get(seq, digest) == digest:
                return  # the overlap of a replay with the live stream
            self._restart()  # the same number with other bytes: a new publisher
            if seq < self.next:
                return  # its replay brought this one
        if seq > self.next and live:
            if self.owed:
                return  # the owed replay brings it, at its retry
            self.metrics.event_gaps.labels(replica=self.src.replica).inc()
            self._replay(self.next)
            if seq < self.next:
                return  # the replay brought it
            if seq > self.next and self.src.replay_endpoint is not None:
                self._restart()  # the buffer no longer holds the missing batches: start over
                return
        self.next = seq + 1  # passed even if it fails below: one bad batch is skipped, once
        self.seen[seq] = digest
        while len(self.seen) > SEEN:
            self.seen.popitem(last=False)
        batch = decode_batch(payload)  # an EventWireError is counted by the caller
        self.index.apply(self.src.replica, batch)
        self.metrics.events_applied.labels(replica=self.src.replica).inc()
        if live:  # a replayed batch is old by design
            lag = max(0.0, time.time() - batch.ts)
            self.metrics.event_lag.labels(replica=self.src.replica).set(lag)

    def _restart(self) -> None:
        """Rebuild the replica's entries from everything its replay socket buffers."""
        self.metrics.event_resets.labels(replica=self.src.replica).inc()
        self.index.add(self.src.replica, self.src.storage)
        self.next = 0
        self.seen.clear()
        self._replay(0)

    def _replay(self, start: int) -> None:
        """Apply the replica's buffered batches from `start` on (none without a replay socket).
        A failure raises (its kind counted by the caller) and leaves the replay owed."""
        if self.src.replay_endpoint is None:
            return
        self._set_whole(False)
        self.metrics.event_replays.labels(replica=self.src.replica).inc()
        try:
            self._apply_replay(start)
        except BufferRolled:
            self._restart()  # its own replay settles what is owed
            return
        except Exception:
            if self._halt.is_set():
                return  # stopping: the replica's entries go with its subscriber
            self.owed, self.failures = True, self.failures + 1
            self.retry_at = time.monotonic() + self.timing.retry_s(self.failures)
            raise
        self.owed, self.failures = False, 0
        self._set_whole(True)

    def _apply_replay(self, start: int) -> None:
        """Read one replay answer from `start`, applying each batch as it comes."""
        assert self.src.replay_endpoint is not None
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, self.timing.rcv_hwm)
        dealer.connect(self.src.replay_endpoint)
        answer = replayed(
            dealer, self.src.replay_endpoint, start, self.timing.wait_s, self._halt.is_set
        )
        try:
            for i, (seq, payload) in enumerate(answer):
                if i == 0 and 0 < start < seq:  # from 0 the buffer's start is all there is
                    raise BufferRolled(f"asked for {start}, the replay starts at {seq}")
                self._guarded(lambda: self._take(seq, payload, live=False))  # noqa: B023
        finally:
            dealer.close()

    def _set_whole(self, whole: bool) -> None:
        self.index.set_whole(self.src.replica, whole)
        self.metrics.index_whole.labels(replica=self.src.replica).set(int(whole))

"""KV event replay, on a thread of its own: the engine thread never serves a socket.

The publisher (kvstrata/serve/events.py, engine thread) appends each event batch to a bounded
`ReplayBuffer` (kv_events_buffer batches, the oldest dropped first). A ROUTER socket, served
by its own listener thread (kvstrata/listeners.py), answers a request [start_seq (8 bytes)]
with every buffered batch from that sequence number on, each as (seq, payload), then
(-1 as 8 signed bytes, empty).

A subscriber may make kv_events_replay_rate requests per second (a burst of as many, at least
one); requests over its rate are dropped unanswered and counted (`limited`). A subscriber is
its CURVE public key under CURVE (a reconnect is the same subscriber), else its connection.
The thread handles at most ROUND requests per PACE_S whatever comes in: a flood waits in
ZMQ's queues (bounded by the socket's high-water mark, fair-queued per connection, so a quiet
subscriber's request is among the next ROUND), and costs the engine at most that pace.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from kvstrata.listeners import Listeners
from kvstrata.zmq_curve import CurveKeys

END_SEQ = (-1).to_bytes(8, "big", signed=True)
LISTENER = "kv-events-replay"  # the thread's name (/metrics label, debug kill)
ROUND = 64  # requests handled per turn at most
PACE_S = 0.01  # a full turn is followed by this pause: the thread's share of the process
POLL_S = 0.1  # an idle turn's wait for a request (bounds how late a stop is seen)
RCV_HWM = 1000  # requests queued per connection before ZMQ stops reading that connection
MAX_SUBSCRIBERS = 4096  # rate buckets kept (the least recently seen are forgotten first)


class ReplayBuffer:
    """The last `size` event batches (seq, payload), shared by the engine and replay threads."""

    def __init__(self, size: int) -> None:
        self._items: deque[tuple[int, bytes]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._items.append((seq, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """Every kept batch with seq >= start, in order (seqs are consecutive)."""
        with self._lock:
            if not self._items:
                return []
            skip = max(0, start - self._items[0][0])
            return list(itertools.islice(self._items, skip, None))

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class Bucket:
    """One subscriber's token bucket: `tokens` requests it may make now, refilled over time."""

    tokens: float
    at: float  # monotonic time of the last refill


class RateLimit:
    """Requests per second per subscriber (a burst of max(1, rate) requests)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.burst = rate, max(1.0, rate)
        self.buckets: dict[bytes, Bucket] = {}  # insertion order: least recently seen first

    def allow(self, who: bytes, now: float) -> bool:
        b = self.buckets.pop(who, None) or Bucket(self.burst, now)
        b.tokens, b.at = min(self.burst, b.tokens + (now - b.at) * self.rate), now
        self.buckets[who] = b  # most recently seen last
        if len(self.buckets) > MAX_SUBSCRIBERS:
            del self.buckets[next(iter(self.buckets))]
        if b.tokens < 1.0:
            return False
        b.tokens -= 1.0
        return True


class ReplayServer:
    """The replay ROUTER socket and the thread that alone uses it."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        buffer: ReplayBuffer,
        rate: float,
        keys: CurveKeys | None = None,
        listeners: Listeners | None = None,
    ) -> None:
        self.buffer, self.limit = buffer, RateLimit(rate)
        self.listeners = listeners or Listeners()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        if keys is not None:
            keys.server(self.sock)
        self.sock.bind(endpoint)  # at start: a taken port fails the server's start, not later
        self.served = self.limited = 0  # requests answered / dropped over their rate
        self._stop = threading.Event()
        self.thread = self.listeners.start(LISTENER, self._step, self._stop)

    def _step(self) -> None:
        """One turn: up to ROUND requests, then a pause if that many came (a flood)."""
        if not self.sock.poll(int(POLL_S * 1000)):
            return
        handled = 0
        while handled < ROUND and self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            handled += 1
            try:
                self._answer(frames)
            except Exception as exc:  # noqa: BLE001 - one request fails alone
                self.listeners.failed(LISTENER, exc)
        if handled == ROUND:
            self._stop.wait(PACE_S)

    def _answer(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2 or len(frames[-1].bytes) > 8:
            raise ValueError(f"a replay request is [start seq (8 bytes)], got {len(frames)} frames")
        client = frames[0].bytes
        if not self.limit.allow(subscriber(frames[0]) or client, time.monotonic()):
            self.limited += 1
            return
        self.served += 1
        for seq, payload in self.buffer.since(int.from_bytes(frames[-1].bytes, "big")):
            self.sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.sock.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        """Stop the thread (within POLL_S + PACE_S), then close its socket."""
        self._stop.set()
        self.thread.join(5.0)
        self.sock.close(0)


def subscriber(frame: zmq.Frame) -> bytes:
    """The CURVE public key (z85) the peer of `frame` authenticated with (b"": no CURVE)."""
    try:
        return (frame.get("User-Id") or "").encode()
    except zmq.ZMQError:  # no ZAP handler on this socket: no user id
        return b""

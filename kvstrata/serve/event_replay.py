"""KV event replay, on a thread of its own: the engine thread never serves a socket.

The publisher (kvstrata/serve/events.py, engine thread) appends each event batch to a bounded
`ReplayBuffer` (kv_events_buffer batches, the oldest dropped first). A ROUTER socket, served
by its own listener thread (kvstrata/listeners.py), answers a request [start_seq (8 bytes)]
with every buffered batch from that sequence number on, framed as vLLM frames its replays:
(empty delimiter, topic, seq, payload), then (empty, empty topic, -1 as 8 signed bytes, empty).

An answer is whole or recognisably cut, never silently short: the socket is ROUTER_MANDATORY
and every message goes out NOBLOCK, so a message the subscriber's queue cannot take (it reads
slower than the answer comes: our SNDHWM, the kernel's buffers and its RCVHWM are full) or a
subscriber gone is refused, not dropped; the answer stops there without its end marker (`cut`). ZMQ delivers one
connection's messages in order and whole, so an end marker proves every batch before it came;
a subscriber that sees none within its wait knows its replay failed and asks again from where
it got to. The thread never blocks on a slow reader.

Two limits make a flood cost the flooder, not the engine's process:
- A total budget (kv_events_replay_budget messages per second, all subscribers together: a
  request read costs one, each message of its answer one more). Once it is spent the thread
  reads nothing until it refills: requests wait unread in ZMQ's queue (RCV_HWM per connection;
  a ROUTER does not drop at its receive high-water mark, it stops reading that connection), then
  in the kernel's TCP buffers, then the flooder's own sends block. A request over the budget is
  never received, parsed or decrypted (CURVE decrypts in ZMQ's I/O thread as messages are taken).
- A rate per subscriber (kv_events_replay_rate requests per second, a burst of as many, at least
  one): a request read over it is dropped unanswered (`dropped`). A subscriber is its CURVE
  public key under CURVE (a reconnect is the same subscriber), else its connection.
ZMQ fair-queues reads across connections, so an honest subscriber's request is read within one
read per other busy connection: its answer comes within (busy connections + 1) x (the largest
request's cost, kv_events_buffer + 2, + the budget's burst) / budget seconds, however fast anyone
floods. Fair shares are per connection, not per key: a subscriber with many connections has as
many shares.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import zmq
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.cache.event_wire import END_SEQ
from kvstrata.listeners import Listeners
from kvstrata.zmq_curve import CurveKeys

LISTENER = "kv-events-replay"  # the thread's name (/metrics label, debug kill)
POLL_S = 0.1  # an idle turn's wait for a request (bounds how late a stop is seen)
RCV_HWM = 16  # requests queued per connection before ZMQ stops reading that connection
BURST_S = 0.01  # the budget's burst: this many seconds of it (the thread's longest stretch)
MAX_SUBSCRIBERS = 4096  # rate buckets kept (the least recently seen are forgotten first)


@dataclass(frozen=True)
class ReplayLimits:
    """What the replay thread may do (ServeConfig's kv_events_replay_* options)."""

    rate: float  # requests per second per subscriber
    budget: float  # messages per second in all (requests read + answer messages sent)


class Clock(Protocol):
    """The replay thread's time: `now` (seconds) and `pause` (wait, ends early on a stop)."""

    def now(self) -> float: ...

    def pause(self, seconds: float) -> None: ...


class ThreadClock:
    """Monotonic time; a pause ends at once when `stop` is set."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def now(self) -> float:
        return time.monotonic()

    def pause(self, seconds: float) -> None:
        self.stop.wait(seconds)


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


class Budget:
    """The thread's total budget: a token bucket of `rate` messages per second holding at most
    burst = max(1, rate * BURST_S). A request is read only with a token in hand; its answer is
    sent whole and may take the bucket below zero. An empty bucket is waited out until full
    (a flood wakes the thread 1 / BURST_S times a second, not once a message). So by time t the
    thread handled at most burst + rate * (t - start) + one answer's messages."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate, self.burst = rate, max(1.0, rate * BURST_S)
        self.tokens, self.at = self.burst, now

    def wait_s(self, now: float) -> float:
        """Seconds until the next read may start (0: now)."""
        self.tokens, self.at = min(self.burst, self.tokens + (now - self.at) * self.rate), now
        return 0.0 if self.tokens >= 1.0 else (self.burst - self.tokens) / self.rate

    def spend(self, messages: int) -> None:
        self.tokens -= messages


class ReplayServer:
    """The replay ROUTER socket and the thread that alone uses it."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        buffer: ReplayBuffer,
        limits: ReplayLimits,
        keys: CurveKeys | None = None,
        listeners: Listeners | None = None,
        clock: Clock | None = None,
        topic: bytes = b"",
    ) -> None:
        self._stop = threading.Event()
        self.topic = topic  # the PUB socket's topic: an answer's batches are framed as published
        self.clock = clock or ThreadClock(self._stop)
        self.buffer, self.limit = buffer, RateLimit(limits.rate)
        self.budget = Budget(limits.budget, self.clock.now())
        self.listeners = listeners or Listeners()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer refuses, not drops
        if keys is not None:
            keys.server(self.sock)
        self.sock.bind(endpoint)  # at start: a taken port fails the server's start, not later
        self.answered = self.dropped = 0  # requests answered whole / dropped over their rate
        self.cut = 0  # answers stopped short (the subscriber's queue full, or it left)
        self.messages = 0  # messages handled: requests read + answer messages sent
        self.deferrals, self.deferred_s = 0, 0.0  # budget pauses with a request waiting, seconds
        self.thread = self.listeners.start(LISTENER, self._step, self._stop)

    def _step(self) -> None:
        """One turn: wait out the budget (nothing read meanwhile), or read and answer one."""
        wait = self.budget.wait_s(self.clock.now())
        if wait > 0.0:
            if self.sock.poll(0):
                self.deferrals, self.deferred_s = self.deferrals + 1, self.deferred_s + wait
            self.clock.pause(wait)
            return
        if not self.sock.poll(int(POLL_S * 1000)):
            return
        frames = self.sock.recv_multipart(copy=False)
        sent = 0
        try:
            sent = self._answer(frames)
        except Exception as exc:  # noqa: BLE001 - one request fails alone
            self.listeners.failed(LISTENER, exc)
        self.budget.spend(1 + sent)
        self.messages += 1 + sent

    def _answer(self, frames: list[zmq.Frame]) -> int:
        """Answer one request (unless over its subscriber's rate); the messages sent."""
        if len(frames) < 2 or len(frames[-1].bytes) > 8:
            raise ValueError(f"a replay request is [start seq (8 bytes)], got {len(frames)} frames")
        client = frames[0].bytes
        if not self.limit.allow(subscriber(frames[0]) or client, self.clock.now()):
            self.dropped += 1
            return 0
        batches = self.buffer.since(int.from_bytes(frames[-1].bytes, "big"))
        for sent, (seq, payload) in enumerate(batches):
            if not self._send(client, self.topic, seq.to_bytes(8, "big"), payload):
                self.cut += 1  # no end marker: the subscriber sees its replay failed
                return sent
        if not self._send(client, b"", END_SEQ, b""):
            self.cut += 1
            return len(batches)
        self.answered += 1
        return len(batches) + 1

    def _send(self, client: bytes, topic: bytes, seq: bytes, payload: bytes) -> bool:
        """One answer message [delimiter, topic, seq, payload] (vLLM's replay frames; the end
        marker has an empty topic), never waiting; False: refused (the subscriber's queue is
        full, or it is gone), nothing of it queued."""
        try:
            self.sock.send_multipart((client, b"", topic, seq, payload), zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def close(self) -> None:
        """Stop the thread (within POLL_S or its pause), then close its socket."""
        self._stop.set()
        self.thread.join(5.0)
        self.sock.close(0)


class ReplayMetrics(Collector):
    """The replay thread's counters, read at scrape time (plain integers)."""

    def __init__(self, server: ReplayServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        s = self.server
        requests = CounterMetricFamily(
            "kvstrata:kv_events_replay_requests",
            "replay requests read: answered whole, cut short without an end marker (the "
            "subscriber's queue full, or it left), or dropped over their subscriber's rate",
            labels=["outcome"],
        )
        requests.add_metric(["answered"], s.answered)
        requests.add_metric(["cut"], s.cut)
        requests.add_metric(["dropped"], s.dropped)
        yield requests
        yield CounterMetricFamily(
            "kvstrata:kv_events_replay_messages",
            "messages the replay thread handled (requests read + answer messages sent)",
            value=s.messages,
        )
        yield CounterMetricFamily(
            "kvstrata:kv_events_replay_deferrals",
            "pauses of the replay thread at its total budget while a request waited unread",
            value=s.deferrals,
        )
        yield CounterMetricFamily(
            "kvstrata:kv_events_replay_deferred_seconds",
            "seconds the replay thread left waiting requests unread, its budget spent",
            value=s.deferred_s,
        )


def subscriber(frame: zmq.Frame) -> bytes:
    """The CURVE public key (z85) the peer of `frame` authenticated with (b"": no CURVE)."""
    try:
        return (frame.get("User-Id") or "").encode()
    except zmq.ZMQError:  # no ZAP handler on this socket: no user id
        return b""

"""The KV events replay thread's total budget, on a real ROUTER (inproc) with a clock the test
moves: a flood is read at most budget x time (+ a burst and one answer), the rest waits unread
and the flooder's own sends block; the flooder is answered at its rate only; an honest
subscriber's replay comes within the documented bound, however long the flood; /metrics counts
what was answered, dropped and deferred. No wall-clock timing: the thread's time is the test's."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvstrata.serve.event_replay import (
    END_SEQ,
    RCV_HWM,
    ReplayBuffer,
    ReplayLimits,
    ReplayMetrics,
    ReplayServer,
)

BUDGET = 1000.0  # messages per second in all
RATE = 5.0  # requests per second per subscriber
BURST = 10.0  # the budget's burst (BUDGET * BURST_S)
BATCHES = 3  # buffered event batches: a full answer is BATCHES + 1 messages
FLOOD_SNDHWM = 16  # the flooder's own queue


class StepClock:
    """The replay thread's clock: it stands still until the test moves it to the thread's next
    wake-up (`wake`), so what the thread does at each instant is exact."""

    def __init__(self) -> None:
        self.t = 0.0
        self.until: float | None = None  # the end of the pause the thread is in
        self.released = False
        self.cond = threading.Condition()

    def now(self) -> float:
        with self.cond:
            return self.t

    def pause(self, seconds: float) -> None:
        with self.cond:
            target = self.t + seconds
            self.until = target
            self.cond.notify_all()
            while self.t < target and not self.released:
                self.cond.wait()

    def wake(self) -> float:
        """Wait until the thread pauses (its budget spent), then move time to its wake-up."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.until is not None, 30), "no pause in 30 s"
            assert self.until is not None
            self.t, self.until = self.until, None
            self.cond.notify_all()
            return self.t

    def settle(self) -> None:
        """Wait until the thread pauses (it handles nothing more until the next `wake`)."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.until is not None, 30), "no pause in 30 s"

    def release(self) -> None:
        with self.cond:
            self.released = True
            self.cond.notify_all()


@pytest.fixture
def setup() -> Iterator[tuple[zmq.Context, ReplayServer, StepClock]]:
    ctx, clock = zmq.Context(), StepClock()
    buffer = ReplayBuffer(100)
    for seq in range(BATCHES):
        buffer.append(seq, b"batch%d" % seq)
    srv = ReplayServer(ctx, "inproc://replay", buffer, ReplayLimits(RATE, BUDGET), clock=clock)
    try:
        yield ctx, srv, clock
    finally:
        clock.release()
        srv.close()
        ctx.destroy(0)  # the test's sockets too, if it failed before closing them


def dealer(ctx: zmq.Context, hwm: int = 1000) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.connect("inproc://replay")
    return sock


class Flooder(threading.Thread):
    """Replay requests from seq 0 as fast as its socket takes them (a send waits while the queue
    is full); drains what comes back, counting complete answers (END)."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(daemon=True)
        self.sock = dealer(ctx, FLOOD_SNDHWM)
        self.stop, self.sent, self.answered = threading.Event(), 0, 0

    def run(self) -> None:
        request = (b"", (0).to_bytes(8, "big"))
        while not self.stop.is_set():
            events = self.sock.poll(10, zmq.POLLIN | zmq.POLLOUT)
            if events & zmq.POLLOUT:
                self.sock.send_multipart(request, zmq.NOBLOCK)
                self.sent += 1
            self.drain()
        self.drain()
        self.sock.close()

    def drain(self) -> None:
        while self.sock.poll(0):
            self.answered += self.sock.recv_multipart()[-2] == END_SEQ


def test_a_flood_is_read_at_the_budget_and_an_honest_replay_comes_within_the_bound(
    setup: tuple[zmq.Context, ReplayServer, StepClock],
) -> None:
    ctx, srv, clock = setup
    flooder, honest = Flooder(ctx), dealer(ctx)
    flooder.start()
    asked_at: float | None = None
    got_at: float | None = None
    queue = 2 * (FLOOD_SNDHWM + RCV_HWM)  # what the flooder may have sent and not been read
    for turn in range(400):  # 400 wake-ups: a few seconds of the thread's time
        now = clock.wake()
        sent = flooder.sent  # before `reads`: the thread only adds to that
        reads = srv.answered + srv.dropped
        # the budget: every message handled was paid for, but for the burst and one answer
        assert srv.messages <= BURST + BUDGET * now + BATCHES + 1
        # what was not read waits in the two queues: the flooder's sends were refused
        assert sent - reads <= queue + 1  # + the one read and not yet counted
        if turn == 200:  # the flood is under way: an honest subscriber asks
            honest.send_multipart((b"", (1).to_bytes(8, "big")))
            asked_at = now
        if asked_at is not None and got_at is None and honest.poll(0):
            want = [[s.to_bytes(8, "big"), b"batch%d" % s] for s in range(1, BATCHES)]
            assert [honest.recv_multipart()[-2:] for _ in range(BATCHES)] == [*want, [END_SEQ, b""]]
            got_at = now
    clock.settle()  # the thread handles nothing more: every answer is in the flooder's queue
    flooder.stop.set()
    flooder.join(30)
    sent, answered = flooder.sent, flooder.answered
    elapsed = clock.now()
    assert elapsed > 1.0  # the flood ran for a while of the thread's time
    assert srv.messages >= BUDGET * elapsed / 2  # and was read at the budget, not below it
    assert 0 <= sent - (srv.answered + srv.dropped) <= queue
    # the flooder: answered at its rate only, every other request of its that was read dropped
    assert answered == srv.answered - 1
    assert 1 <= answered <= RATE + RATE * elapsed
    # the honest subscriber: two busy connections, each read costs a full answer at most
    assert got_at is not None and asked_at is not None
    assert got_at - asked_at <= 2 * (BATCHES + 2 + BURST) / BUDGET
    assert srv.deferrals > 0 and srv.deferred_s > 0.0
    registry = CollectorRegistry()
    registry.register(ReplayMetrics(srv))
    value = registry.get_sample_value
    assert value("kvstrata:kv_events_replay_requests_total", {"outcome": "answered"}) == (
        srv.answered
    )
    assert value("kvstrata:kv_events_replay_requests_total", {"outcome": "dropped"}) == srv.dropped
    assert value("kvstrata:kv_events_replay_deferrals_total") == srv.deferrals
    honest.close()

"""A KV event replay is whole or recognisably failed, never a partial replay taken as whole, on real
ZMQ sockets: the replay ROUTER stops an answer its reader's queue cannot take, without its end
marker, and counts it `cut`; the router's subscriber, reading too slowly for a long answer, sees
its replay fail, counts the replica's holdings as unknown meanwhile, and asks again from where it
got to until its index holds every batch; an answer with batches missing (a publisher that drops
what its queue cannot take and still ends the answer, as a plain ROUTER does) is a failed replay."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import zmq
from prometheus_client import CollectorRegistry

from kvstrata.cache.event_wire import END_SEQ, EventBatch
from kvstrata.router.index import FleetIndex, Match
from kvstrata.router.metrics import FleetMetrics
from kvstrata.router.replay_client import ReplayTiming
from kvstrata.router.subscriber import EventSource, Subscriber
from kvstrata.serve.event_replay import ReplayBuffer, ReplayLimits, ReplayMetrics, ReplayServer

LONG = 4000  # batches in the long replay: more than the ROUTER's queue, the kernel's and ours
SNDHWM = 1000  # ZMQ's default send high-water mark (the replay ROUTER's)
READER_HWM = 10  # the slow reader's receive queue
OPEN = ReplayLimits(rate=1e6, budget=1e9)  # limits that never bind here
TIMING = ReplayTiming(wait_s=0.5, first_retry_s=0.05, max_retry_s=0.2, rcv_hwm=READER_HWM)


def stored(seq: int) -> bytes:
    """Batch `seq`: block seq + 1 stored on device (with 200 tokens, ~600 bytes: a long answer
    fills the kernel's socket buffers too), in vLLM's format."""
    event = {"type": "BlockStored", "block_hashes": [seq + 1], "parent_block_hash": None,
             "token_ids": list(range(1000, 1200)), "block_size": 200, "medium": "GPU"}  # fmt: skip
    return bytes(msgpack.packb([0.0, [event], 0]))


def long_buffer(n: int = LONG) -> ReplayBuffer:
    buffer = ReplayBuffer(n)
    for seq in range(n):
        buffer.append(seq, stored(seq))
    return buffer


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.01)


def read_all(sock: zmq.Socket, wait_ms: int) -> list[list[bytes]]:
    """Every message that comes until the end marker, or until none does for `wait_ms` (the
    DEALER's empty delimiter off)."""
    got: list[list[bytes]] = []
    while (not got or got[-1][0] != END_SEQ) and sock.poll(wait_ms):
        got.append(sock.recv_multipart()[-2:])
    return got


def test_an_answer_its_reader_cannot_take_is_cut_without_its_end_marker() -> None:
    ctx = zmq.Context()
    srv = ReplayServer(ctx, "inproc://replay", long_buffer(), OPEN)
    try:
        slow = ctx.socket(zmq.DEALER)
        slow.setsockopt(zmq.RCVHWM, READER_HWM)
        slow.connect("inproc://replay")
        slow.send_multipart((b"", (0).to_bytes(8, "big")))
        wait_for(lambda: srv.cut == 1, "cut answer")  # it reads nothing until then
        got = read_all(slow, 200)
        # an inproc queue holds the ROUTER's SNDHWM and the reader's RCVHWM: exactly those
        # batches came, the first ones in order, and no end marker after them
        assert len(got) == SNDHWM + READER_HWM
        assert got == [[s.to_bytes(8, "big"), stored(s)] for s in range(len(got))]
        assert (srv.answered, srv.cut, srv.messages) == (0, 1, 1 + len(got))
        # the reader asks again from where it got to, reading as it comes: the rest, then END
        fast = ctx.socket(zmq.DEALER)
        fast.setsockopt(zmq.RCVHWM, 0)  # unbounded: an inproc answer then always fits
        fast.connect("inproc://replay")
        fast.send_multipart((b"", len(got).to_bytes(8, "big")))
        rest = read_all(fast, 5000)
        want = [[s.to_bytes(8, "big"), stored(s)] for s in range(len(got), LONG)]
        assert rest == [*want, [END_SEQ, b""]]
        assert (srv.answered, srv.cut) == (1, 1)
        registry = CollectorRegistry()
        registry.register(ReplayMetrics(srv))
        value = registry.get_sample_value
        outcomes = {o: value("kvstrata:kv_events_replay_requests_total", {"outcome": o})
                    for o in ("answered", "cut", "dropped")}  # fmt: skip
        assert outcomes == {"answered": 1, "cut": 1, "dropped": 0}
    finally:
        srv.close()
        ctx.destroy(0)


class GatedIndex(FleetIndex):
    """The router's index, whose first `apply` waits for `gate`: a subscriber that stops reading
    its replay socket in the middle of a long answer."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.waited = threading.Event(), False

    def apply(self, replica: str, batch: EventBatch) -> None:
        if not self.waited:
            self.waited = True
            assert self.gate.wait(60), "the test never opened the gate"
        super().apply(replica, batch)


def subscribe(
    tmp_path: Path, index: FleetIndex, replay: str
) -> tuple[Subscriber, CollectorRegistry]:
    """A subscriber of replica "r" (its PUB endpoint silent: only the replay socket speaks)."""
    reg = CollectorRegistry()
    src = EventSource("r", f"ipc://{tmp_path}/pub", replay, b"", None, "")
    index.add("r", "")
    sub = Subscriber(src, index, FleetMetrics(reg), None, TIMING)
    sub.start()
    return sub, reg


def failures(reg: CollectorRegistry, kind: str) -> float | None:
    """Replica "r"'s event failures of `kind` (a failed replay counts one)."""
    labels = {"replica": "r", "kind": kind}
    return reg.get_sample_value("kvstrata:router_event_failures_total", labels)


def test_a_subscriber_that_falls_behind_retries_until_its_index_is_whole(tmp_path: Path) -> None:
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/replay"  # ipc: kernel buffers of a fixed, small size
    srv = ReplayServer(ctx, endpoint, long_buffer(), OPEN)
    index = GatedIndex()
    sub, reg = subscribe(tmp_path, index, endpoint)
    value = reg.get_sample_value
    try:
        wait_for(lambda: srv.cut == 1, "cut answer")  # the subscriber stopped reading
        # its replay is under way and not whole: the replica's holdings count as unknown
        assert not index.whole("r") and value("kvstrata:router_index_whole", {"replica": "r"}) == 0
        assert index.match("r", "", [1]) == Match(0, 0, 0)
        index.gate.set()
        wait_for(lambda: index.whole("r"), "whole replay")
        assert index.blocks("r")["GPU"] == set(range(1, LONG + 1))  # every batch, exactly
        assert index.match("r", "", [1]) == Match(1, 1, 1)
        failed = failures(reg, "TimeoutError")
        assert failed is not None and failed == srv.cut >= 1  # each cut answer failed, no other
        assert value("kvstrata:router_event_replays_total", {"replica": "r"}) == failed + 1
        assert srv.answered == 1 and value("kvstrata:router_index_whole", {"replica": "r"}) == 1
        assert value("kvstrata:router_event_batches_total", {"replica": "r"}) == LONG
    finally:
        index.gate.set()
        sub.stop()
        sub.join(10)
        srv.close()
        ctx.destroy(0)
    assert not sub.is_alive()


def test_an_answer_with_batches_missing_is_a_failed_replay(tmp_path: Path) -> None:
    """A plain ROUTER (no ROUTER_MANDATORY) that dropped batch 2 of its first answer and still
    ended it; vLLM's framing (topic, seq, payload)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/replay"
    router.bind(endpoint)
    index = FleetIndex()
    sub, reg = subscribe(tmp_path, index, endpoint)
    asked = []
    try:
        for answer in ([0, 1, 3], [2, 3]):
            assert router.poll(10_000), "no replay request within 10 s"
            client, _, start = router.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            for seq in answer:
                router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), stored(seq)))
            router.send_multipart((client, b"", b"", END_SEQ, b""))
        wait_for(lambda: index.whole("r"), "whole replay")
        assert asked == [0, 2]  # the second from the batch that was missing
        assert index.blocks("r")["GPU"] == {1, 2, 3, 4}
        assert failures(reg, "ReplayFailed") == 1
        assert reg.get_sample_value("kvstrata:router_event_replays_total", {"replica": "r"}) == 2
    finally:
        sub.stop()
        sub.join(10)
        router.close(0)
        ctx.destroy(0)
    assert not sub.is_alive()

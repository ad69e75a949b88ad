"""The fleet router's event subscriber (kvstrata/router/subscriber.py) on real ZMQ sockets: a
message that is not an event batch is counted and skipped, the batches around it are applied; a
publisher that starts again at sequence 0 (a restarted replica) rebuilds the replica's entries."""

from __future__ import annotations

import time

import zmq
from prometheus_client import CollectorRegistry

from kvstrata.cache.event_wire import BlockStored, encode_batch
from kvstrata.local_ports import free_port
from kvstrata.router.index import FleetIndex, Match
from kvstrata.router.metrics import FleetMetrics
from kvstrata.router.subscriber import EventSource, Subscriber


def stored(*hashes: int) -> bytes:
    return encode_batch([BlockStored(list(hashes), None, [], 4, "GPU", [""] * len(hashes))],
                        "vllm", time.time())  # fmt: skip


def wait_for(check: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_bad_messages_are_skipped_and_a_restart_rebuilds() -> None:
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    reg = CollectorRegistry()
    metrics, index = FleetMetrics(reg), FleetIndex()
    index.add("r", "")
    src = EventSource("r", f"tcp://127.0.0.1:{port}", None, b"", None, "")
    sub = Subscriber(src, index, metrics, None)
    first = stored(1)
    try:
        sub.start()
        while index.match("r", "", [1]) != Match(1, 1, 1):  # until it is subscribed (the same
            pub.send_multipart((b"", (0).to_bytes(8, "big"), first))  # bytes: applied once)
            time.sleep(0.05)
        for seq, payload in enumerate([b"\xc1 not msgpack", stored(2)], start=1):
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        pub.send_multipart((b"", b"short"))  # not (topic, seq, payload)
        wait_for(lambda: index.match("r", "", [1, 2]) == Match(2, 2, 2), "both batches applied")
        failures = reg.get_sample_value(
            "kvstrata:router_event_failures_total", {"replica": "r", "kind": "EventWireError"}
        )
        assert failures == 1
        # a new publisher (other bytes under sequence 0): the entries start again
        pub.send_multipart((b"", (0).to_bytes(8, "big"), stored(7)))
        wait_for(lambda: index.match("r", "", [7]) == Match(1, 1, 1), "the restart's batch")
        assert index.match("r", "", [1]) == Match(0, 0, 0)
        assert reg.get_sample_value("kvstrata:router_event_resets_total", {"replica": "r"}) == 1
    finally:
        sub.stop()
        sub.join(10)
        pub.close(0)
        ctx.term()
    assert not sub.is_alive()

"""The KV events replay socket under a flood, on a real `kvstrata serve`: a ZMQ client that
sends replay requests as fast as it can while completions run. The engine keeps stepping (every
completion finishes, its output the cold run's), the flooder is answered only at its rate, the
replay thread handles at most its budget (/metrics) and leaves the rest of the flood unread, a
malformed request is counted and the next one served, and a quiet subscriber's replay returns
exactly the batches the PUB socket sent. Then the replay thread is killed: /health answers 503
and the server exits 1. (TTFT under the flood: `kvstrata bench replay_flood`.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import zmq

from kvstrata.serve.codec import ByteCodec
from tests.serve_helpers import TINY_ENGINE, Server, reserved_ports, subscribed
from tests.tiny_models import hf_greedy, load_hf

pytestmark = pytest.mark.slow  # a real server process

CKPT = {"seed": 4, "max_position_embeddings": 256}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""

RATE = 2.0  # --kv-events-replay-rate: replay requests per second per subscriber
BUDGET = 500.0  # --kv-events-replay-budget: messages per second in all
END = (-1).to_bytes(8, "big", signed=True)
FAILURES = 'kvstrata:listener_message_failures_total{listener="kv-events-replay"}'


class Flooder(threading.Thread):
    """Replay requests from seq 0 without pause on one connection; counts answers (END)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.stop, self.sent, self.answered = threading.Event(), 0, 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sock.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:
                time.sleep(0.001)
            while self.sock.poll(0):
                self.answered += self.sock.recv_multipart()[-2] == END
        self.sock.close()


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """A quiet subscriber's replay from `start`: every (seq, payload) until END."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            assert sock.poll(30_000), "no replay answer within 30 s"
            seq, payload = sock.recv_multipart()[-2:]  # [delimiter, topic, seq, payload]
            if seq == END:
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


def metric(url: str, name: str) -> float:
    """A sample of the server's /metrics (0 when it has none yet)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def failures(url: str) -> float:
    return metric(url, FAILURES)


def test_a_replay_flood_costs_the_flooder_not_the_engine(ckpt: Path, tmp_path: Path) -> None:
    with reserved_ports(2) as (pub_port, replay_port):
        args = [
            "--model", str(ckpt), *TINY_ENGINE, "--device-pages", "64", "--host-pages", "64",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
            "--kv-events-replay-rate", str(RATE), "--kv-events-replay-budget", str(BUDGET),
            "--debug-endpoints",
        ]  # fmt: skip
        started = time.monotonic()  # before the replay thread's first read
        srv = Server(args, tmp_path / "srv.log")
    endpoint = f"tcp://127.0.0.1:{replay_port}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    flooder = Flooder(ctx, endpoint)
    try:
        subscribed(sub, f"tcp://127.0.0.1:{pub_port}")
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        hf = load_hf(ckpt)
        flooder.start()
        t0 = time.monotonic()
        for i in range(4):  # the engine steps on while the flood goes on
            prompt = [(7 * i + 3 * j + 1) % 97 for j in range(33)]
            r = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=0, timeout=120
            )
            assert r.choices[0].text == ByteCodec(97).decode(hf_greedy(hf, prompt, 6))
        flooder.stop.set()
        flooder.join(30)
        elapsed = time.monotonic() - t0
        assert flooder.sent > 10 * (RATE * elapsed + RATE)  # it did flood
        assert 1 <= flooder.answered <= RATE * elapsed + RATE + 1  # answered at its rate only
        assert srv.wait_idle()["ok"]
        published = []
        while sub.poll(1000):
            _, seq, payload = sub.recv_multipart()
            published.append((int.from_bytes(seq, "big"), payload))
        assert published and [s for s, _ in published] == list(range(len(published)))
        # the thread read at most its budget: a burst, budget x its lifetime, one answer
        handled = metric(srv.url, "kvstrata:kv_events_replay_messages_total")
        lifetime = time.monotonic() - started
        assert 0 < handled <= BUDGET / 100 + BUDGET * lifetime + len(published) + 2
        dropped = metric(srv.url, 'kvstrata:kv_events_replay_requests_total{outcome="dropped"}')
        assert flooder.sent - dropped - flooder.answered > 0  # the rest was never read
        # a malformed request fails alone: counted, and the next one is answered
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(endpoint)
        bad.send_multipart((b"", b"x" * 20))
        assert not bad.poll(500)
        bad.close()
        assert replay(ctx, endpoint, 0) == published  # a quiet subscriber: exact batches
        assert replay(ctx, endpoint, 2) == published[2:]
        assert failures(srv.url) == 1
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        # a replay thread that dies: /health 503, then the server leaves with exit 1
        r = httpx.post(f"{srv.url}/debug/listeners/kv-events-replay/kill", timeout=10)
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 10.0
        while (h := httpx.get(f"{srv.url}/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 10 s after the kill"
            time.sleep(0.05)
        assert h.status_code == 503 and "kv-events-replay" in h.text, h.text
        assert srv.proc.wait(60) == 1
    finally:
        flooder.stop.set()
        sub.close()
        srv.stop()
        ctx.term()

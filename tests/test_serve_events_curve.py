"""KV events under ZMQ CURVE (a real `kvstrata serve`): a subscriber whose public key the server
allows gets the events, over PUB and the replay ROUTER; one with another key pair, or with no
CURVE at all, gets nothing; a fleet router holding the allowed key pair indexes the pages."""

from __future__ import annotations

import time
from pathlib import Path

import httpx2 as httpx
import openai
import zmq
import zmq.auth

from kvstrata.cache.event_wire import BlockStored, decode_batch
from kvstrata.cli.keys_cmd import write_curve_pair
from kvstrata.serve.process import ServerProcess
from tests.serve_helpers import TINY_ENGINE, Server, reserved_ports, subscribed
from tests.tiny_models import make_llama

PROMPT = [(11 * i + 4) % 97 for i in range(33)]


def _socket(
    ctx: zmq.Context, kind: int, server_public: bytes | None, cert: Path | None
) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if cert is not None:  # a CURVE client with this key pair
        public, secret = zmq.auth.load_certificate(str(cert))
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_public
    return sock


def test_only_allowed_subscribers_get_events(tmp_path: Path) -> None:
    ckpt = make_llama(tmp_path / "tiny", seed=5, max_position_embeddings=256)
    server_pub, server_secret = write_curve_pair(tmp_path / "server", "events")
    allowed_pub, allowed_secret = write_curve_pair(tmp_path / "clients", "router")
    _, stranger_secret = write_curve_pair(tmp_path / "strangers", "eve")  # not in clients/
    with reserved_ports(2) as (pub_port, replay_port):  # held until the server binds them
        args = [
            "--model", str(ckpt), *TINY_ENGINE, "--device-pages", "64", "--host-pages", "64",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
            "--kv-events-curve-secret-file", str(server_secret),
            "--kv-events-curve-clients-dir", str(tmp_path / "clients"), "--debug-endpoints",
        ]  # fmt: skip
        srv = Server(args, tmp_path / "srv.log")
    server_key = zmq.auth.load_certificate(str(server_pub))[0]
    ctx = zmq.Context()
    subs = {
        "allowed": _socket(ctx, zmq.SUB, server_key, allowed_secret),
        "stranger": _socket(ctx, zmq.SUB, server_key, stranger_secret),
        "plain": _socket(ctx, zmq.SUB, None, None),
    }
    try:
        for name, s in subs.items():
            s.setsockopt(zmq.SUBSCRIBE, b"")
            if name != "allowed":  # their handshakes fail: nothing to wait for
                s.connect(f"tcp://127.0.0.1:{pub_port}")
        subscribed(subs["allowed"], f"tcp://127.0.0.1:{pub_port}")  # before the first event
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
        assert subs["allowed"].poll(10_000), "the allowed subscriber got no event in 10 s"
        topic, seq, payload = subs["allowed"].recv_multipart()
        assert int.from_bytes(seq, "big") == 0
        assert isinstance(decode_batch(payload).events[0], BlockStored)
        # the others: their handshakes failed, so nothing was (or will be) delivered to them
        assert not subs["stranger"].poll(1000) and not subs["plain"].poll(0)
        replies = {}
        for name, cert in (("allowed", allowed_secret), ("stranger", stranger_secret)):
            dealer = _socket(ctx, zmq.DEALER, server_key, cert)
            dealer.connect(f"tcp://127.0.0.1:{replay_port}")
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            replies[name] = dealer.poll(10_000 if name == "allowed" else 1000)
            if replies[name]:
                assert dealer.recv_multipart()[-2] == seq  # batch 0 replayed
            dealer.close()
        assert replies == {"allowed": zmq.POLLIN, "stranger": 0}
        # a fleet router with the allowed key pair, trusting the server's key, indexes its pages
        router = ServerProcess(
            ["--role", "router", "--replicas", srv.url, "--debug-endpoints",
             "--router-kv-events-curve-secret-file", str(allowed_secret),
             "--router-kv-events-curve-peers-dir", str(tmp_path / "server")],
            tmp_path / "router.log", 60,
        )  # fmt: skip
        try:
            own = httpx.get(f"{srv.url}/debug/blocks", timeout=10).json()
            deadline = time.monotonic() + 20
            while httpx.get(f"{router.url}/debug/fleet/blocks").json() != {srv.url: own}:
                assert time.monotonic() < deadline, "the router's index never matched the server's"
                time.sleep(0.1)
            assert own["GPU"]
        finally:
            assert router.terminate() == 0, router.log.read_text()
    finally:
        for s in subs.values():
            s.close()
        ctx.term()
        assert srv.terminate() == 0

"""`POST /reset_prefix_cache` on a real server: device memory forgotten (host too with
reset_external), the KV events say AllBlocksCleared and a subscriber's rebuilt sets equal the
cache's own after it; refused ({"success": false}, as vLLM) while a request runs, and with
reset_running_requests=true that request is preempted, recomputes and ends with the same text as
undisturbed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import zmq

from kvstrata.cache.event_wire import AllBlocksCleared, decode_batch
from tests.serve_helpers import TINY_ENGINE, Server, apply_events, reserved_ports, subscribed

PROMPTS = [[(5 * i + 2 + k) % 97 for i in range(41)] for k in range(2)]  # 5 hittable pages each
LONG = [(3 * i + 7) % 97 for i in range(30)]


CKPT = {"seed": 9, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


class Subscriber:
    """Rebuilds the per-medium block sets from the server's KV events."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        subscribed(self.sub, f"tcp://127.0.0.1:{port}")
        self.held: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "DISK": set()}
        self.cleared = 0  # AllBlocksCleared events seen

    def catch_up(self, srv: Server) -> dict[str, set[int]]:
        """Apply events until the sets equal the cache's own (10 s at most); the cache's own."""
        srv.wait_idle()
        own = {m: set(v) for m, v in httpx.get(f"{srv.url}/debug/blocks").json().items()}
        deadline = time.monotonic() + 10
        while self.held != own and time.monotonic() < deadline:
            if self.sub.poll(200):
                payload = self.sub.recv_multipart()[2]
                events = decode_batch(payload).events
                self.cleared += sum(isinstance(ev, AllBlocksCleared) for ev in events)
                apply_events(payload, self.held)
        assert self.held == own
        return own

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


def cached(client: openai.OpenAI, prompt: list[int]) -> tuple[str, dict[str, int]]:
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]


def reset(srv: Server, query: str = "") -> httpx.Response:
    return httpx.post(f"{srv.url}/reset_prefix_cache{query}", timeout=60)


@pytest.mark.slow
def test_reset_clears_device_then_host_and_events_follow(ckpt: Path, tmp_path: Path) -> None:
    with reserved_ports(1) as (port,):  # held until the server binds it
        args = [
            "--model", str(ckpt), *TINY_ENGINE, "--device-pages", "64", "--host-pages", "64",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "--debug-endpoints",
        ]  # fmt: skip
        srv = Server(args, tmp_path / "srv.log")
    sub = Subscriber(port)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        first = [cached(client, p) for p in PROMPTS]
        assert first[0][1] == {"device": 0, "host": 0, "storage": 0}
        before = sub.catch_up(srv)
        assert before["GPU"] and before["CPU"] == before["GPU"]  # write-through: host copies too
        r = reset(srv)
        assert r.status_code == 200 and r.json() == {"success": True}
        after = sub.catch_up(srv)
        assert sub.cleared == 1 and after == {"GPU": set(), "CPU": before["CPU"], "DISK": set()}
        text, tiers = cached(client, PROMPTS[0])
        assert text == first[0][0] and tiers == {"device": 0, "host": 40, "storage": 0}
        assert reset(srv, "?reset_external=true").json() == {"success": True}
        assert sub.catch_up(srv) == {"GPU": set(), "CPU": set(), "DISK": set()}
        assert sub.cleared == 2
        text, tiers = cached(client, PROMPTS[1])
        assert text == first[1][0] and tiers == {"device": 0, "host": 0, "storage": 0}
        bad = reset(srv, "?reset_external=maybe")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reset_external"
        assert srv.integrity()["ok"]
    finally:
        sub.close()
        assert srv.terminate() == 0
    assert "Traceback" not in (tmp_path / "srv.log").read_text()


@pytest.mark.slow
def test_refused_while_running_and_preempted_on_request(ckpt: Path, tmp_path: Path) -> None:
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "64", "--debug-endpoints"]
    srv = Server(args, tmp_path / "run.log")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 400, "temperature": 0}
    try:
        want = client.completions.create(**body).choices[0].text
        assert reset(srv).json() == {"success": True}  # idle: nothing holds pages
        parts: list[str] = []
        started = threading.Event()

        def stream() -> None:
            for chunk in client.completions.create(**body, stream=True):
                parts.append(chunk.choices[0].text)
                started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        refused = reset(srv)  # as vLLM: 200, success false (callers may retry)
        assert refused.status_code == 200 and refused.json()["success"] is False
        assert "1 requests are running" in refused.json()["message"]
        assert reset(srv, "?reset_running_requests=true").json() == {"success": True}
        t.join(120)
        assert not t.is_alive() and "".join(parts) == want  # preempted, recomputed, same text
        assert srv.wait_idle()["ok"]
    finally:
        assert srv.terminate() == 0
    assert "Traceback" not in (tmp_path / "run.log").read_text()

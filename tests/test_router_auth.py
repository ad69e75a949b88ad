"""The router and its workers authenticate each other, with real processes and the official
openai client: the router enforces its own API key (401 for a client without it, /health open),
sends the workers' key as a Bearer token on every worker request (/v1/pd/info at start, the
completions), decode sends it on prefill's /v1/pd/info, and a router without the workers' key
stops at start naming the 401. Outputs equal the cold run. The router applies the server's HTTP
rules itself (a wrong content type, a malformed or oversized body, a slow client never reach a
worker)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from kvstrata.local_ports import free_port
from kvstrata.serve.codec import ByteCodec
from kvstrata.serve.process import ServerProcess
from tests.pd_helpers import start_all, worker_args
from tests.serve_helpers import raw_http, trickle
from tests.tiny_models import hf_greedy, load_hf

pytestmark = pytest.mark.slow  # two workers and two routers as real processes

CKPT = {"seed": 4, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""

PROMPT = [(7 * i + 3) % 97 for i in range(30)]
ROUTER_CAP = 64 << 10  # the keyed router's --max-request-bytes (the workers keep 16 MiB)
SLOW_S = 4.0  # the keyed router's --client-timeout-s


def key_file(path: Path, key: str) -> str:
    path.write_text(key + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def cluster(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Keyed prefill and decode workers (one worker key), a router with its own client key and
    the workers' key, and a router that uses the workers' key for both."""
    tmp = tmp_path_factory.mktemp("auth")
    wk, rk = key_file(tmp / "worker.key", "worker-secret"), key_file(tmp / "router.key", "client")
    keyed = ["--api-key-file", wk]
    port = free_port()
    p, d = start_all(
        [
            (worker_args(ckpt, "--role", "prefill", *keyed), tmp / "p.log", port),
            (worker_args(ckpt, "--role", "decode", *keyed, "--pd-prefill",
                         f"http://127.0.0.1:{port}", "--pd-prefill-api-key-file", wk),
             tmp / "d.log"),
        ]
    )  # fmt: skip
    up = ["--role", "router", "--prefill", p.url, "--decode", d.url]
    routers = []
    try:
        routers.append(ServerProcess([*up, "--api-key-file", rk,
                                      "--router-worker-api-key-file", wk,
                                      "--max-request-bytes", str(ROUTER_CAP),
                                      "--client-timeout-s", str(SLOW_S)], tmp / "r1.log", 60))  # fmt: skip
        routers.append(ServerProcess([*up, "--api-key-file", wk], tmp / "r2.log", 60))
        yield {"p": p, "d": d, "r": routers[0], "same": routers[1], "up": up, "rk": rk}
    finally:
        for r in routers:
            assert r.terminate() == 0, r.log.read_text()
        for s in (p, d):
            s.stop()


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_router_enforces_its_key_and_sends_the_workers_key(
    cluster: dict[str, Any], ckpt: Path
) -> None:
    want = ByteCodec(97).decode(hf_greedy(load_hf(ckpt), PROMPT, 5))
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    for url, key in ((cluster["r"].url, "client"), (cluster["same"].url, "worker-secret")):
        rc = client(url, key)
        assert rc.completions.create(**ask).choices[0].text == want
        chunks = rc.completions.create(**ask, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").completions.create(**ask)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # open, as on workers
    for w in ("p", "d"):  # the workers themselves refuse a client without their key
        for path in ("/v1/pd/info", "/v1/models"):
            assert httpx.get(f"{cluster[w].url}{path}", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):  # the router's key is not the workers'
        client(cluster["d"].url, "client").completions.create(**ask)


def test_a_router_without_the_workers_key_stops_at_start(cluster: dict[str, Any]) -> None:
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--port", str(free_port())]
    cmd += [*cluster["up"], "--api-key-file", cluster["rk"]]  # its own key only
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"worker {cluster['p'].url} refused the router's API key" in out.stderr
    assert "HTTP 401" in out.stderr
    assert "within" not in out.stderr  # the 401 ended the wait at once, not the start timeout


def _routed(url: str) -> list[str]:
    """The router's counters of what it sent on to a worker (and relayed back)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    keep = ("kvstrata:router_requests_total", "kvstrata:router_whole_responses_total")
    return [line for line in text.splitlines() if line.startswith(keep)]


def test_the_router_applies_the_servers_body_rules(cluster: dict[str, Any]) -> None:
    """415 / 400 / 413 / 408 from the router itself, as `kvstrata serve` answers them: nothing
    reaches a worker, and an oversized body is refused from its header (or once its chunks pass
    the cap) instead of growing the router."""
    url, auth = cluster["r"].url, {"Authorization": "Bearer client"}
    routed = _routed(url)
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for extra in ({"Content-Type": "text/plain"}, {}):
            r = httpx.post(f"{url}{path}", content=body, headers={**auth, **extra}, timeout=30)
            assert r.status_code == 415, (path, extra, r.text)
        for raw, words in ((b"", "empty"), (b"{", "malformed JSON"), (b"[1]", "an object")):
            js = {**auth, "Content-Type": "application/json"}
            r = httpx.post(f"{url}{path}", content=raw, headers=js, timeout=30)
            assert r.status_code == 400 and words in r.json()["error"]["message"], (path, r.text)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer client\r\n"
        f"Content-Type: application/json\r\nContent-Length: {300 << 20}\r\n\r\n"
    )
    reply = raw_http(cluster["r"].port, head)  # 300 MiB declared, not one byte sent
    assert reply.startswith("HTTP/1.1 413") and str(ROUTER_CAP) in reply, reply
    chunk = b"[" * 8192
    part = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    head = head.replace(f"Content-Length: {300 << 20}", "Transfer-Encoding: chunked")
    reply = raw_http(cluster["r"].port, head, part * (ROUTER_CAP // len(chunk) + 1))
    assert reply.startswith("HTTP/1.1 413") and str(ROUTER_CAP) in reply, reply
    with socket.create_connection(("127.0.0.1", cluster["r"].port), timeout=30) as sock:
        reply, took = trickle(sock, head.encode(), SLOW_S + 60)  # slowloris: 1 byte a second
    assert reply.startswith("HTTP/1.1 408") and took < SLOW_S + 60, reply
    assert _routed(url) == routed  # none of it reached a worker
    r = httpx.post(
        f"{url}/v1/completions",
        content=body,
        headers={**auth, "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    assert _routed(url) != routed

"""`kvstrata serve --role router` as a real process in front of one prefill and two decode
worker processes, through the official openai client: the same greedy answers as a single
server, streamed or not; round robin over the two decode workers; worker errors passed through;
a dead worker is a clear 502; a client that goes away aborts the worker's request; a worker
listed under the wrong role is refused at start."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from kvstrata.local_ports import free_port
from kvstrata.serve.process import ServerProcess
from tests.pd_helpers import start_all
from tests.serve_helpers import TINY_ENGINE, Server, refused_port

pytestmark = pytest.mark.slow  # several real server processes (minutes on a loaded box)

NO_INFO = ["--no-router-require-info"]


def prompt(offset: int, n: int = 41) -> list[int]:
    return [(5 * i + 2 + offset) % 97 for i in range(n)]


CKPT = {"seed": 1, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def start_workers(ckpt: Path, roles: list[str], logs: Path) -> list[Server]:
    """All at once; every decode worker lists every prefill worker (ports picked first)."""
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "96", "--debug-endpoints"]
    ports = [free_port() if r == "prefill" else 0 for r in roles]
    prefill = ",".join(f"http://127.0.0.1:{p}" for p in ports if p)
    specs = [
        ([*args, "--role", r, *(["--pd-prefill", prefill] if r == "decode" else [])],
         logs / f"worker{i}.log", ports[i])
        for i, r in enumerate(roles)
    ]  # fmt: skip
    return start_all(specs)


@pytest.fixture(scope="module")
def workers(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """[prefill, decode 0, decode 1], real P/D workers; the prefill worker, asked directly,
    is also the single-server reference (its HTTP API serves like `--role single`)."""
    srvs = start_workers(ckpt, ["prefill", "decode", "decode"], tmp_path_factory.mktemp("logs"))
    try:
        yield srvs
    finally:
        for s in srvs:
            assert s.terminate() == 0, s.log.read_text()


@pytest.fixture(scope="module")
def router(workers: list[Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prefill: worker 0; decode: workers 1 and 2 in turn; roles checked at start."""
    p, d1, d2 = (w.url for w in workers)
    log = tmp_path_factory.mktemp("router") / "router.log"
    proc = ServerProcess(["--role", "router", "--prefill", p, "--decode", f"{d1},{d2}"], log, 60)
    yield proc.url
    assert proc.terminate() == 0, log.read_text()


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def routed(worker: Server) -> float:
    """Completion requests the worker has served (its own Prometheus counter)."""
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    m = re.search(r"^kvstrata:e2e_request_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_router_answers_like_a_single_server_streamed_or_not(
    router: str, workers: list[Server]
) -> None:
    rc = client_of(router)
    assert [m.id for m in rc.models.list().data] == ["tiny"]
    whole = [
        rc.completions.create(model="tiny", prompt=prompt(1), max_tokens=7, temperature=0)
        for _ in range(2)  # one per decode worker, each cold: its KV comes from prefill
    ]
    assert whole[0].usage.completion_tokens == 7 and whole[0].usage.prompt_tokens == 41
    assert all(w.usage.model_extra["pd"]["pages_received"] > 0 for w in whole)
    chunks = list(
        rc.completions.create(
            model="tiny", prompt=prompt(1), max_tokens=7, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    direct = client_of(workers[0].url).completions.create(
        model="tiny", prompt=prompt(1), max_tokens=7, temperature=0
    )  # the single-server path, same model
    assert {w.choices[0].text for w in whole} == {direct.choices[0].text}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.choices[0].text
    assert chunks[-1].usage.completion_tokens == 7 and "pd" in chunks[-1].usage.model_extra
    msgs = [{"role": "user", "content": "hello router"}]
    chat = rc.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
    streamed = rc.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=5, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    want = client_of(workers[0].url).chat.completions.create(
        model="tiny", messages=msgs, max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.content == text == want.choices[0].message.content


def test_round_robin_over_two_decode_workers(router: str, workers: list[Server]) -> None:
    decodes = workers[1:]
    before = [routed(w) for w in decodes]
    rc = client_of(router)
    for i in range(6):
        rc.completions.create(model="tiny", prompt=prompt(10 + i), max_tokens=2, temperature=0)
    assert [routed(w) - b for w, b in zip(decodes, before, strict=True)] == [3.0, 3.0]
    text = httpx.get(f"{router}/metrics", timeout=10).text
    for w in decodes:
        assert f'kvstrata:router_requests_total{{role="decode",worker="{w.url}"}} ' in text
    assert f'kvstrata:router_requests_total{{role="prefill",worker="{workers[0].url}"}} ' in text


def test_tokenize_detokenize_and_health(router: str) -> None:
    toks = httpx.post(f"{router}/tokenize", json={"prompt": "abc"}, timeout=10).json()
    assert toks["tokens"] == [b % 97 for b in b"abc"] and toks["count"] == 3
    r = httpx.post(f"{router}/detokenize", json={"tokens": [0, 1]}, timeout=10)
    assert r.json() == {"prompt": " !"}
    assert httpx.get(f"{router}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/completions", "{not json", 400, ["malformed JSON"]),
        ("/v1/completions", {"prompt": [1, 97]}, 400, ["97", "out of range"]),
        ("/v1/completions", {"prompt": [1, 2], "model": "gpt-9"}, 404, ["gpt-9"]),
        ("/v1/chat/completions", {"messages": [], "stream": True}, 400, ["messages"]),
        ("/detokenize", {"tokens": [500]}, 400, ["500"]),
    ],
)
def test_worker_errors_pass_through(
    router: str, path: str, body: object, status: int, words: list[str]
) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    kind = {"Content-Type": "application/json"}  # the router refuses any other (415)
    r = httpx.post(f"{router}{path}", content=data, headers=kind, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert all(w in err["message"] for w in words), err["message"]


def test_client_disconnect_aborts_the_worker_request(router: str, workers: list[Server]) -> None:
    for w in workers:
        w.wait_idle()
    body = {"prompt": prompt(40, 60), "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens, then the client goes away
    assert sum(1 for line in got if line.startswith("data: ")) >= 3
    for w in workers:  # the request is aborted long before its 400 tokens: nothing runs
        rep = w.wait_idle(timeout_s=20)
        assert rep["ok"] and rep["accounting"]["device"]["locked"] == 0


@pytest.fixture
def dead_url() -> Iterator[str]:
    with refused_port() as port:
        yield f"http://127.0.0.1:{port}"


def test_dead_worker_is_a_clear_502(tmp_path: Path, workers: list[Server], dead_url: str) -> None:
    dead = dead_url
    args = ["--role", "router", "--prefill", workers[0].url, "--decode", dead, *NO_INFO]
    proc = ServerProcess(args, tmp_path / "router.log", 60, ready_path="/metrics")
    try:
        r = httpx.post(f"{proc.url}/v1/completions", json={"prompt": [1, 2, 3]}, timeout=30)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["type"] == "BadGatewayError" and dead in err["message"]
        assert "Traceback" not in r.text
        with pytest.raises(openai.APIStatusError) as exc:
            client_of(proc.url).completions.create(model="tiny", prompt=[1, 2], stream=True)
        assert exc.value.status_code == 502
        health = httpx.get(f"{proc.url}/health", timeout=30)
        assert health.status_code == 503 and dead in health.json()["error"]["message"]
    finally:
        assert proc.terminate() == 0, proc.log.read_text()


def test_router_refuses_a_worker_listed_under_the_wrong_role(workers: list[Server]) -> None:
    """Roles are checked at start (GET /v1/pd/info): exit 2, the worker and its role named."""
    import subprocess
    import sys

    decode = workers[1].url
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--role", "router"]
    cmd += ["--port", str(free_port()), "--prefill", decode, "--decode", decode]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"worker {decode} listed as --prefill says role 'decode'" in out.stderr


def router_errors(url: str, role: str, worker: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    # Prometheus prints labels sorted by name.
    labels = f'kind="ConnectError",role="{role}",worker="{re.escape(worker)}"'
    pattern = rf"^kvstrata:router_upstream_errors_total\{{{labels}\}} (\S+)$"
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


def router_routed(url: str, role: str, worker: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = (
        rf'^kvstrata:router_requests_total\{{role="{role}",worker="{re.escape(worker)}"\}} (\S+)$'
    )
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_down(url: str, names: set[str], timeout_s: float = 30.0) -> dict:
    """The router's /health once it lists exactly `names` as down (its probe runs on its own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{url}/health", timeout=30)
        if r.status_code == 200 and set(r.json()["down"]) == names:
            return r.json()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"router /health did not list {names} within {timeout_s} s: {r.text}"
            )
        time.sleep(0.1)


def test_dead_workers_are_skipped_and_requests_still_succeed(ckpt: Path, tmp_path: Path) -> None:
    """Two prefill and two decode workers, killed -9 one by one after the routers started.
    A decode worker that refuses the connection is skipped at once (the request goes to the
    other; one refusal counted), a prefill worker once the router's /health probe finds it dead;
    every request still succeeds with the same tokens; /health stays 200 naming the dead, and
    turns 503 (and requests 502, naming the worker) once a role has none left."""
    p1, p2, d1, d2 = start_workers(ckpt, ["prefill", "prefill", "decode", "decode"], tmp_path)
    cmd = ["--role", "router", "--prefill", f"{p1.url},{p2.url}", "--decode", f"{d1.url},{d2.url}"]
    no_probe = ServerProcess([*cmd, "--router-health-interval-s", "3600"], tmp_path / "r1.log", 60)
    probing = ServerProcess([*cmd, "--router-health-interval-s", "0.2"], tmp_path / "r2.log", 60)
    ask = dict(model="tiny", prompt=prompt(3), max_tokens=3, temperature=0)
    try:
        want = client_of(no_probe.url).completions.create(**ask).choices[0].text  # on d1
        d1.stop()  # kill -9
        for _ in range(4):  # d2, then d1 refuses -> d2, then d1 is skipped
            assert client_of(no_probe.url).completions.create(**ask).choices[0].text == want
        assert router_errors(no_probe.url, "decode", d1.url) == 1.0
        assert router_routed(no_probe.url, "decode", d2.url) == 4.0
        p1.stop()
        wait_down(
            probing.url, {f"prefill {p1.url}: ConnectError", f"decode {d1.url}: ConnectError"}
        )
        for _ in range(4):
            assert client_of(probing.url).completions.create(**ask).choices[0].text == want
        assert router_routed(probing.url, "prefill", p2.url) == 4.0
        assert router_routed(probing.url, "prefill", p1.url) == 0.0
        assert d2.wait_idle()["ok"] and p2.wait_idle()["ok"]
        d2.stop()
        assert httpx.get(f"{probing.url}/health", timeout=30).status_code == 503
        r = httpx.post(f"{probing.url}/v1/completions", json={"prompt": [1, 2]}, timeout=30)
        msg = r.json()["error"]["message"]
        assert r.status_code == 502 and d1.url in msg and d2.url in msg, r.text
    finally:
        for router in (no_probe, probing):
            assert router.terminate() == 0, router.log.read_text()
        for s in (p1, p2, d1, d2):
            s.stop()

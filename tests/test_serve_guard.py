"""`kvstrata serve --api-key-file` as a real process: nothing but /health and /metrics answers
without the key (through the official openai client and raw HTTP); bodies are JSON only, bounded,
and any malformed JSON is a 400; a request whose sampling parameters underflow (temperature or
top_p 1e-300) is computed stably alongside its batch mates."""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from kvstrata.serve.auth import API_KEY_ENV, resolve_api_key
from tests.serve_helpers import TINY_ENGINE, Server
from tests.tiny_models import make_llama

KEY = "sk-test-3b9f1c0e"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json", **AUTH}
CAP = 256 << 10  # --max-request-bytes of the server below (the 100k-deep body fits)
PROMPT = [(5 * i + 2) % 97 for i in range(30)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("guard")
    ckpt = make_llama(tmp / "tiny", seed=3, max_position_embeddings=256)
    (tmp / "key").write_text(KEY + "\n")
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "96", "--host-pages", "64"]
    args += ["--api-key-file", str(tmp / "key"), "--max-request-bytes", str(CAP)]
    srv = Server([*args, "--debug-endpoints"], tmp / "server.log")
    yield srv
    assert srv.terminate() == 0, (tmp / "server.log").read_text()


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_client_needs_the_key(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(server, "wrong").completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 401
    err = info.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").models.list()
    good = client(server, KEY)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    out = good.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/reset_prefix_cache?reset_external=true"),
        ("GET", "/debug/integrity"),
        ("GET", "/debug/blocks"),
        ("POST", "/v1/kv/prefetch"),
        ("GET", "/debug/pins"),
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
    ],
)
def test_every_endpoint_but_health_and_metrics_is_closed(
    server: Server, method: str, path: str
) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, f"{server.url}{path}", headers=headers, timeout=30)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["code"] == 401
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    r = httpx.request(method, f"{server.url}{path}", headers=AUTH, timeout=30)
    assert r.status_code != 401


def test_api_key_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key("", "") is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")  # read when the server starts, not at import
    assert resolve_api_key("", "") == "from-env"
    assert resolve_api_key("flag", "") == "flag"
    (tmp_path / "k").write_text("from-file\n")
    assert resolve_api_key("", str(tmp_path / "k")) == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key("", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("flag", str(tmp_path / "k"))


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_content_types_are_parsed(server: Server, ctype: str | None) -> None:
    headers = dict(AUTH) if ctype is None else {**AUTH, "Content-Type": ctype}
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1})
    for path in ("/v1/completions", "/tokenize"):
        r = httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=30)
        assert r.status_code == 415, r.text
        assert r.json()["error"]["type"] == "UnsupportedMediaTypeError"
    ok = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    r = httpx.post(f"{server.url}/tokenize", content='{"prompt": "ab"}', headers=ok, timeout=30)
    assert r.status_code == 200 and r.json()["count"] == 2


def _bad_bodies() -> list[tuple[str, bytes, str]]:
    deep = b'{"prompt": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    big_int = b'{"prompt": [1], "max_tokens": ' + b"7" * 5000 + b"}"
    return [
        ("nesting 100k deep", deep, "nested too deeply"),
        ("lone surrogate", b'{"prompt": "a\\ud800b"}', "lone surrogate"),
        ("lone surrogate key", b'{"\\udfff": 1, "prompt": "a"}', "lone surrogate"),
        ("5000-digit integer", big_int, "malformed JSON"),
        ("NaN temperature", b'{"prompt": [1], "temperature": NaN}', "temperature"),
        ("inf temperature", b'{"prompt": [1], "temperature": Infinity}', "temperature"),
        ("NaN top_p", b'{"prompt": [1], "top_p": NaN}', "top_p"),
        ("negative top_p", b'{"prompt": [1], "top_p": -0.5}', "top_p"),
        ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', "malformed JSON"),
        ("a list", b"[1, 2]", "must be an object"),
    ]


@pytest.mark.parametrize(
    ("what", "body", "words"), _bad_bodies(), ids=[b[0] for b in _bad_bodies()]
)
def test_malformed_json_is_a_400(server: Server, what: str, body: bytes, words: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers=JSON, timeout=30)
    assert r.status_code == 400, (what, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "BadRequestError"
    assert words in err["message"], err["message"]


def _raw(server: Server, head: str, body: bytes = b"") -> str:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _length(reply):
            got = sock.recv(1 << 16)  # the head and body may come in separate segments
            if not got:
                break
            reply += got
        return reply.decode(errors="replace")


def _length(reply: bytes) -> int:
    """The Content-Length of a reply's head (0 when it has none)."""
    m = re.search(rb"(?im)^content-length: *(\d+)", reply)
    return int(m.group(1)) if m else 0


def test_body_over_the_cap_is_refused_before_it_is_read(server: Server) -> None:
    # Content-Length of 50 MB and not one body byte sent: the 413 comes from the header alone
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
    )
    reply = _raw(server, head)
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "--max-request-bytes" in reply and str(CAP) in reply
    # chunked (no length): refused once the chunks pass the cap, the rest never sent
    chunk = b"[" * 8192
    part = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    head = head.replace("Content-Length: 50000000", "Transfer-Encoding: chunked")
    reply = _raw(server, head, part * (CAP // len(chunk) + 1))
    assert reply.startswith("HTTP/1.1 413"), reply
    r = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "a" * (CAP - 100)}, headers=AUTH, timeout=30
    )
    assert r.status_code == 200  # just under the cap is fine


def test_underflowing_sampling_is_stable_and_batch_mates_finish(server: Server) -> None:
    """temperature / top_p 1e-300 made torch.multinomial raise inside a step (failing every
    running request); now the distribution is computed stably: its limit, the greedy token."""
    c = client(server, KEY)
    prompts = [[(3 * i + j) % 97 for i in range(25)] for j in range(4)]
    greedy = [
        c.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in prompts
    ]
    kinds = [
        {"temperature": 1e-300},
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 5e-324, "top_p": 1e-300},
        {"temperature": 0},
    ]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=6, **kinds[i])
            got[i] = out.choices[0].text
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [got[i] for i in range(4)] == greedy
    rep = httpx.get(f"{server.url}/debug/integrity", headers=AUTH, timeout=30).json()
    assert rep["ok"]

"""`kvstrata serve --api-key-file` as a real process: nothing but /health and /metrics answers
without the key (through the official openai client and raw HTTP); a key with whitespace around it
is refused at start and a key file others may read is named in one warning line; bodies are JSON
only, bounded, and any malformed JSON is a 400, as is a field this server would otherwise ignore
(best_of, logprobs), a token id that is not an integer and an empty cache_salt; a client that
trickles its headers or body is cut off; a request whose sampling parameters underflow
(temperature or top_p 1e-300) is computed stably alongside its batch mates."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from kvstrata.http.auth import API_KEY_ENV, resolve_api_key
from tests.serve_helpers import TINY_ENGINE, Server, raw_http, read_reply, trickle
from tests.tiny_models import make_llama

KEY = "sk-test-3b9f1c0e"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json", **AUTH}
CAP = 256 << 10  # --max-request-bytes of the server below (the 100k-deep body fits)
SLOW_S = 4.0  # --client-timeout-s of the server below
PROMPT = [(5 * i + 2) % 97 for i in range(30)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("guard")
    ckpt = make_llama(tmp / "tiny", seed=3, max_position_embeddings=256)
    (tmp / "key").write_text(KEY + "\n")
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "96", "--host-pages", "64"]
    args += ["--api-key-file", str(tmp / "key"), "--max-request-bytes", str(CAP)]
    args += ["--client-timeout-s", str(SLOW_S)]  # the key file stays 0644: one warning line
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


@pytest.mark.parametrize("key", [" lead", "trail ", "tab\t", "two\nlines"])
def test_a_key_with_whitespace_around_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    """Never trimmed: the server would require a key other than the one the operator gave."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    (tmp_path / "k").write_text(key + "\n")
    for given, names in (((key, ""), "--api-key"), (("", str(tmp_path / "k")), "--api-key-file")):
        with pytest.raises(ValueError, match=names):
            resolve_api_key(*given)
    monkeypatch.setenv(API_KEY_ENV, key)
    with pytest.raises(ValueError, match=re.escape(f"${API_KEY_ENV}")):
        resolve_api_key("", "")


def test_the_router_refuses_an_untrimmed_key_at_start() -> None:
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--role", "router"]
    cmd += [
        "--api-key",
        "sk-1 ",
        "--prefill",
        "http://127.0.0.1:9",
        "--decode",
        "http://127.0.0.1:9",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "kvstrata serve: error: --api-key: the key has leading or trailing whitespace; remove "
        "it (keys are compared exactly)"
    ]


def test_a_key_file_others_may_read_is_warned_about(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    warned = [line for line in server.log.read_text().splitlines() if "warning" in line]
    assert len(warned) == 1 and "--api-key-file" in warned[0] and "mode 644" in warned[0], warned
    (tmp_path / "k").write_text("sk-1\n")
    (tmp_path / "k").chmod(0o640)
    assert resolve_api_key("", str(tmp_path / "k")) == "sk-1"
    assert "group/others may access it (mode 640); chmod 600" in capsys.readouterr().err
    (tmp_path / "k").chmod(0o600)
    assert resolve_api_key("", str(tmp_path / "k")) == "sk-1"
    assert capsys.readouterr().err == ""


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


def test_body_over_the_cap_is_refused_before_it_is_read(server: Server) -> None:
    # Content-Length of 50 MB and not one body byte sent: the 413 comes from the header alone
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
    )
    reply = raw_http(server.port, head)
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "--max-request-bytes" in reply and str(CAP) in reply
    # chunked (no length): refused once the chunks pass the cap, the rest never sent
    chunk = b"[" * 8192
    part = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    head = head.replace("Content-Length: 50000000", "Transfer-Encoding: chunked")
    reply = raw_http(server.port, head, part * (CAP // len(chunk) + 1))
    assert reply.startswith("HTTP/1.1 413"), reply
    r = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "a" * (CAP - 100)}, headers=AUTH, timeout=30
    )
    assert r.status_code == 200  # just under the cap is fine


def _bad_fields() -> list[tuple[str, dict[str, Any], str]]:
    """(route, fields over a good body, the field the 400 must name)."""
    return [
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"logprobs": 1000000}, "logprobs"),
        ("/v1/completions", {"logprobs": 0}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 5}, "top_logprobs"),
        ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
        ("/v1/completions", {"prompt": [5.0, 6]}, "prompt"),
        ("/v1/completions", {"prompt": [[5, False]]}, "prompt"),
        ("/v1/completions", {"prompt": ["5", 6]}, "prompt"),
        ("/v1/completions", {"stop_token_ids": [True]}, "stop_token_ids"),
        ("/v1/completions", {"cache_salt": ""}, "cache_salt"),
        ("/v1/chat/completions", {"cache_salt": ""}, "cache_salt"),
        ("/detokenize", {"tokens": [1.0]}, "tokens"),
    ]


GOOD = {
    "/v1/completions": {"model": "tiny", "prompt": PROMPT, "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/detokenize": {"tokens": [1, 2]},
}


@pytest.mark.parametrize(
    ("path", "fields", "name"), _bad_fields(), ids=[f"{b[2]}={b[1]}" for b in _bad_fields()]
)
def test_a_field_this_server_would_ignore_or_coerce_is_a_400(
    server: Server, path: str, fields: dict[str, Any], name: str
) -> None:
    body = {**GOOD[path], **fields}
    r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["param"].split(".")[0] == name and err["message"].startswith(name), err


def test_the_fields_at_their_supported_values_are_served(server: Server) -> None:
    ok = {"best_of": 1, "logprobs": None, "cache_salt": "tenant-a"}
    for path, extra in (
        ("/v1/completions", ok),
        ("/v1/chat/completions", {**ok, "logprobs": False, "top_logprobs": 0}),
    ):
        r = httpx.post(
            f"{server.url}{path}", json={**GOOD[path], **extra}, headers=AUTH, timeout=60
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1


def test_slow_clients_are_cut_off(server: Server) -> None:
    """Slowloris: headers sent one byte a second, on a new connection and on a kept-alive one
    after an answer, and a body sent so after whole headers: each gets --client-timeout-s, then
    a 408 and the connection is closed (the trickle would go on for 60 s more)."""
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    slow = (head + "X-Pad: " + "a" * 60).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        reply, took = trickle(sock, slow, SLOW_S + 60)
    assert reply.startswith("HTTP/1.1 408") and "request headers not received" in reply, reply
    assert SLOW_S - 1 < took < SLOW_S + 60
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_reply(sock).startswith("HTTP/1.1 200")
        reply, took = trickle(sock, slow, SLOW_S + 60)
    assert reply.startswith("HTTP/1.1 408") and took < SLOW_S + 60, reply
    whole = head + "Content-Type: application/json\r\nContent-Length: 80\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(whole.encode())
        reply, took = trickle(sock, b'{"prompt": [1, 2, 3], "x": "' + b"a" * 60, SLOW_S + 60)
    assert reply.startswith("HTTP/1.1 408") and "request body not received" in reply, reply
    assert SLOW_S - 1 < took < SLOW_S + 60


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

"""`kvstrata serve` as a real process on a tiny random Llama, through the official openai client
and raw HTTP: completions, chat, streaming, exact cached-token counts, salts, bad input,
disconnects, 32 concurrent streams, metrics; every pool intact afterwards."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.serve_helpers import TINY_ENGINE, Server

PAGE = 8
PROMPT = [(7 * i + 3) % 97 for i in range(41)]  # 41 tokens: 5 full cacheable pages (+1 token)


CKPT = {"seed": 1, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "192", "--host-pages", "256"]
    srv = Server([*args, "--debug-endpoints", "--max-pending", "64"], log)
    yield srv
    assert srv.terminate() == 0, log.read_text()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def prompt(offset: int, n: int = 41) -> list[int]:
    return [(7 * i + 3 + offset) % 97 for i in range(n)]


def test_models_and_health(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 512
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_streaming_equals_whole_and_cached_tokens_exact(client: openai.OpenAI) -> None:
    p = prompt(1)
    whole = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
    assert whole.choices[0].finish_reason == "length"
    u = whole.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (41, 6, 47)
    assert u.prompt_tokens_details.cached_tokens == 0  # first time this prompt is seen
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text  # greedy: the same tokens, streamed or not
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    details = chunks[-1].usage.prompt_tokens_details
    assert (
        details.cached_tokens == 40
    )  # the 5 full pages of the repeated prompt, from device memory
    assert details.model_extra["cached_tokens_by_tier"] == {"device": 40, "host": 0, "storage": 0}


def test_chat_whole_and_streaming(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert len(whole.choices[0].message.content) == 5  # byte codec: one character per token
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_cache_salts_never_share(client: openai.OpenAI) -> None:
    p = prompt(2)

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        r = client.completions.create(
            model="tiny", prompt=p, max_tokens=1, temperature=0, extra_body=extra
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same tokens, another salt: nothing shared
    assert cached(None) == 0
    assert cached("tenant-a") == 40
    assert cached("tenant-b") == 40


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(
            model="tiny", prompt=prompt(3), max_tokens=12, temperature=1.0, top_p=0.9, seed=seed
        )
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_string_ends_the_request(client: openai.OpenAI, server: Server) -> None:
    full = client.completions.create(model="tiny", prompt=prompt(4), max_tokens=8, temperature=0)
    text = full.choices[0].text
    stop = text[3:5]
    cut = client.completions.create(
        model="tiny", prompt=prompt(4), max_tokens=8, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    server.wait_idle()


def post(server: Server, path: str, body: object) -> httpx.Response:
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=data, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ("{not json", 400, ["malformed JSON"]),
        ({"prompt": [1, 2], "max_tokens": "many"}, 400, ["max_tokens"]),
        ({"prompt": ""}, 400, ["prompt is empty"]),
        ({"prompt": []}, 400, ["prompt is empty"]),
        ({"prompt": [1, 97]}, 400, ["97", "out of range"]),
        ({"prompt": [1, 2], "model": "gpt-9"}, 404, ["gpt-9"]),
        ({"prompt": PROMPT, "max_tokens": 500}, 400, ["512", "541", "41", "500"]),
        ({"prompt": [1, 2], "n": 2}, 400, ["n must be 1"]),
        ({"prompt": [1, 2], "temperature": -1}, 400, ["temperature"]),
        ({"max_tokens": 3}, 400, ["prompt"]),
    ],
)
def test_bad_input_gets_a_clear_400(server: Server, body: object, status: int, words: list) -> None:
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert all(w in err["message"] for w in words), err["message"]
    assert "Traceback" not in r.text


def test_bad_chat_and_tokenize(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(server, "/v1/chat/completions", {"messages": [{"content": "no role"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    toks = post(server, "/tokenize", {"prompt": "abc"}).json()
    assert toks["tokens"] == [b % 97 for b in b"abc"] and toks["count"] == 3
    assert post(server, "/detokenize", {"tokens": [0, 1]}).json() == {"prompt": " !"}
    assert post(server, "/detokenize", {"tokens": [500]}).status_code == 400
    assert server.wait_idle()["ok"]  # nothing above reached the engine or broke it


def test_disconnect_mid_stream_frees_pages(server: Server) -> None:
    before = server.wait_idle()
    body = {"prompt": prompt(5, 100), "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens, then the client goes away
    assert sum(1 for line in got if line.startswith("data: ")) >= 3
    after = server.wait_idle()  # aborted: not running, its pages back (owned == 0)
    assert after["ok"]
    # the aborted request's computed full pages stay cached, nothing else is held
    assert after["accounting"]["device"]["locked"] == 0
    assert after["device_capacity"] == before["device_capacity"]


def test_32_concurrent_streams(server: Server, client: openai.OpenAI) -> None:
    errors: list[BaseException] = []
    texts: dict[int, str] = {}

    def one(i: int) -> None:
        try:
            stream = client.completions.create(
                model="tiny", prompt=prompt(i % 8, 30 + i), max_tokens=8, temperature=0,
                stream=True,
            )  # fmt: skip
            texts[i] = "".join(c.choices[0].text for c in stream if c.choices)
        except BaseException as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert len(texts) == 32 and all(len(t) == 8 for t in texts.values())
    assert server.wait_idle()["ok"]


def test_metrics(server: Server, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt=prompt(6), max_tokens=2, temperature=0)
    client.completions.create(model="tiny", prompt=prompt(6), max_tokens=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "kvstrata:time_to_first_token_seconds_count",
        "kvstrata:inter_token_latency_seconds_count",
        "kvstrata:e2e_request_latency_seconds_count",
        "kvstrata:request_queue_time_seconds_count",
        "kvstrata:num_requests_running",
        "kvstrata:num_requests_waiting",
        "kvstrata:kv_cache_usage_perc",
        "kvstrata:kv_moved_bytes_total",
        "kvstrata:prefetch_total",
        "kvstrata:kv_transfer_failed_pages_total",
        "kvstrata:lost_pages_total",
        "kvstrata:prefetch_no_room_pages_total",
    ):
        lines = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert lines and all('model_name="tiny"' in line for line in lines), name
    values = _samples(text)
    queries = values['kvstrata:prefix_cache_queries_total{model_name="tiny"}']
    hits = values['kvstrata:prefix_cache_hits_total{model_name="tiny"}']
    by_source = {
        s: values[f'kvstrata:prompt_tokens_by_source_total{{model_name="tiny",source="{s}"}}']
        for s in ("computed", "local_device_hit", "local_host_hit", "storage_hit")
    }
    assert sum(by_source.values()) == queries and 0 < hits < queries
    assert (
        hits
        == by_source["local_device_hit"] + by_source["local_host_hit"] + by_source["storage_hit"]
    )
    # two small prompts: the pools hold every page, so none is lost or left unread
    assert values['kvstrata:lost_pages_total{model_name="tiny"}'] == 0
    assert values['kvstrata:prefetch_no_room_pages_total{model_name="tiny"}'] == 0


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _aborted(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    key = 'kvstrata:request_success_total{finished_reason="abort",model_name="tiny"}'
    return _samples(text).get(key, 0.0)


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server: Server) -> None:
    before = _aborted(server)
    body = json.dumps({"prompt": prompt(7, 30), "max_tokens": 470, "temperature": 0}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    # the engine holds still for 3 s from before the request arrives, so the hang-up is seen
    # (polled every 0.25 s) before the answer can be complete, however fast the machine steps
    for bad in (0, 11):  # a hold is bounded: never a hang
        assert httpx.post(f"{server.url}/debug/stall", params={"seconds": bad}).status_code == 400
    assert httpx.post(f"{server.url}/debug/stall", params={"seconds": 3}).status_code == 202
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + body)  # then the client hangs up without reading
    deadline = time.monotonic() + 30
    while _aborted(server) == before:
        assert time.monotonic() < deadline, "the dropped request was not aborted within 30 s"
        time.sleep(0.05)
    assert server.wait_idle()["ok"]

"""Client pins and prefetch hints through a real `kvstrata serve` on a tiny random Llama:
`cache_control` / `kv_pin_s` keep a prefix through a storm of other prompts, a bad TTL is a 400
naming it, salts keep tenants apart, a prefetch hint moves exactly the pages it names, and every
output equals the cold run's."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.serve_helpers import TINY_ENGINE, Server

PAGE = 8
CKPT = {"seed": 4, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""

PINNED = [(5 * i + 1) % 97 for i in range(41)]  # 5 full pages (+1 token)


def storm_prompt(k: int) -> list[int]:
    return [(13 * i + 7 * k + 2) % 97 for i in range(121)]  # 15 full pages


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("pins")
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "24", "--host-pages", "32"]
    args += ["--storage-url", str(tmp / "store"), "--debug-endpoints"]
    srv = Server(args, tmp / "server.log")
    yield srv
    assert srv.terminate() == 0, (tmp / "server.log").read_text()


def complete(srv: Server, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def text_and_cached(out: dict[str, Any]) -> tuple[str, int, int]:
    """(text, tokens the device and host served, tokens pinned); storage hits are not counted:
    a pinned page must not have left memory."""
    d = out["usage"]["prompt_tokens_details"]
    tiers = d["cached_tokens_by_tier"]
    return out["choices"][0]["text"], tiers["device"] + tiers["host"], d["pinned_tokens"]


def metric(srv: Server, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    pat = re.compile(rf"^kvstrata:{re.escape(name)} (\S+)$", re.M)
    found = pat.search(text)
    assert found is not None, f"{name} not in /metrics"
    return float(found.group(1))


def storm(srv: Server, first: int, n: int = 4) -> None:
    for k in range(first, first + n):
        complete(srv, storm_prompt(k))


def test_bad_ttls_are_400s_naming_the_value(server: Server) -> None:
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "10m"}}]},
        {"role": "user", "content": "hi"},
    ]  # fmt: skip
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 3}, timeout=30
    )
    assert r.status_code == 400 and "'10m'" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages.0.content.0.cache_control.ttl"
    body = {"prompt": PINNED, "kv_pin_s": 7200, "max_tokens": 3}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "7200" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "kv_pin_s"


def test_pinned_prompt_survives_a_storm_and_equals_the_cold_run(server: Server) -> None:
    cold = text_and_cached(complete(server, PINNED, kv_pin_s=300))
    assert cold[1:] == (0, 40)  # 5 full pages pinned
    first_storm = text_and_cached(complete(server, storm_prompt(0)))
    storm(server, 1)  # 4 x 15 pages through 24 device + 32 host pages
    assert text_and_cached(complete(server, storm_prompt(0)))[1] == 0  # the storm took it all
    again = text_and_cached(complete(server, PINNED))
    assert again == (cold[0], 40, 0)  # every pinned page a hit; no pin asked this time
    assert text_and_cached(complete(server, storm_prompt(0)))[0] == first_storm[0]
    server.wait_idle()
    assert metric(server, 'pinned_pages{model_name="tiny",tier="host"}') == 5
    assert metric(server, 'pins_made_total{model_name="tiny"}') >= 1


def test_chat_cache_control_pins_the_prefix_up_to_its_part(server: Server) -> None:
    system = "You are a careful coding agent. " * 3
    marked = {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}
    msgs = [{"role": "system", "content": [marked]}, {"role": "user", "content": "list files"}]
    full = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}).json()["tokens"]
    upto = [{"role": "system", "content": system}]
    cut = httpx.post(f"{server.url}/tokenize", json={"messages": upto}).json()["tokens"]
    common = next(i for i, (a, b) in enumerate(zip(cut, full, strict=False)) if a != b)
    body = {"model": "tiny", "messages": msgs, "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert r["usage"]["prompt_tokens_details"]["pinned_tokens"] == common // PAGE * PAGE > 0


def test_pins_and_hints_stay_within_their_salt(server: Server) -> None:
    prompt = [(11 * i + 5) % 97 for i in range(33)]  # 4 full pages
    assert text_and_cached(complete(server, prompt, kv_pin_s=60, cache_salt="a"))[2] == 32
    hint = httpx.post(f"{server.url}/v1/kv/prefetch", json={"prompt": prompt, "cache_salt": "b"})
    assert hint.status_code == 200 and hint.json()["pages"] == {
        "device": 0,
        "host": 0,
        "storage": 0,
    }
    own = httpx.post(f"{server.url}/v1/kv/prefetch", json={"prompt": prompt, "cache_salt": "a"})
    assert sum(own.json()["pages"].values()) == 4
    other = text_and_cached(complete(server, prompt, kv_pin_s=60, cache_salt="b"))
    assert other[1:] == (0, 32)  # its own pages, pinned apart
    pins = httpx.get(f"{server.url}/debug/pins").json()
    assert len([p for p in pins[0]["pins"] if p[0] == 4]) == 2  # one per salt
    server.wait_idle()


def test_prefetch_moves_exactly_the_pages_named(server: Server) -> None:
    prompt = [(3 * i + 11) % 97 for i in range(81)]  # 10 full pages
    cold = text_and_cached(complete(server, prompt))
    server.wait_idle()  # written through to storage
    reset = httpx.post(f"{server.url}/reset_prefix_cache?reset_external=true", timeout=60)
    assert reset.json()["success"]
    moved = 'kv_moved_bytes_total{direction="storage->host",model_name="tiny"}'
    before = metric(server, moved)
    hint = httpx.post(f"{server.url}/v1/kv/prefetch", json={"prompt": prompt[:48]}, timeout=30)
    assert hint.json()["pages"] == {"device": 0, "host": 0, "storage": 6}
    server.wait_idle()
    after_hint = metric(server, moved)
    out = complete(server, prompt)
    by_tier = out["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    assert by_tier["device"] + by_tier["host"] == 48 and by_tier["storage"] == 32
    assert out["choices"][0]["text"] == cold[0]
    server.wait_idle()
    total = metric(server, moved) - before
    assert (after_hint - before) * 10 == total * 6 > 0  # the hint moved 6 of the 10 pages


@pytest.mark.slow
def test_tp2_ranks_pin_and_expire_the_same_pages(ckpt: Path, tmp_path: Path) -> None:
    """Under `--tp 2` the pins enter with the request on every rank and expire on the agreed
    step clock: both ranks hold the same pins, before and after expiry; outputs equal cold."""
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "24", "--host-pages", "32"]
    srv = Server([*args, "--tp", "2", "--debug-endpoints"], tmp_path / "two.log")
    try:
        cold = text_and_cached(complete(srv, PINNED, kv_pin_s=300))
        short = [(17 * i + 3) % 97 for i in range(25)]  # 3 full pages
        assert text_and_cached(complete(srv, short, kv_pin_s=1))[2] == 24
        time.sleep(1.2)  # past the short pin's deadline; the storm's steps tick past it
        storm(srv, 10, 3)
        pins = httpx.get(f"{srv.url}/debug/pins", timeout=30).json()
        assert len(pins) == 2 and pins[0] == pins[1] and pins[0]["pinned"] == 5
        assert [p[0] for p in pins[0]["pins"]] == [5]  # the 1 s pin expired during the storm
        assert text_and_cached(complete(srv, PINNED)) == (cold[0], 40, 0)
        srv.wait_idle()
    finally:
        assert srv.terminate() == 0, (tmp_path / "two.log").read_text()

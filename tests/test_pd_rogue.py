"""A prefill worker against a hostile local peer, with the defaults (no key option given): real
worker processes on 127.0.0.1.

- P/D transfer is authenticated by default: a peer without CURVE gets nothing through, while
  a decode worker started alongside (no option either) hands off end to end.
- A peer that holds the keys (trusted to read) and answers prefill's pull with made-up pages
  (correct checksums): that request may use them, but nothing of it reaches prefill's tree or
  the shared store, and the next client of the same prompt gets the cold run's output.
- A malformed hand-off (a field of the wrong type or out of range) is refused naming the field;
  the listener thread keeps serving and /health stays 200.
- A listener thread that dies anyway takes /health to 503 and the server out (exit 1).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import pytest
import torch

from kvstrata.pd.transport import TRANSPORTS, ZmqTransport
from kvstrata.pd.wire import Frames, header, pack_keys, pulled_message, read_header, read_pages
from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import (
    complete,
    info,
    keys_of,
    local_curve,
    metrics,
    raw_handoff,
    start_all,
    worker_args,
)
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf, rel_err

pytestmark = pytest.mark.slow  # real worker processes

CKPT = {"seed": 3, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""

FAILURES = 'kvstrata:listener_message_failures_total{listener="pd-prefill"}'
REFUSED = 'kvstrata:pd_handoffs_total{model_name="tiny",outcome="failed"}'


@pytest.fixture(scope="module")
def workers(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A prefill p with a storage directory and a decode d that lists p; no key option."""
    tmp = tmp_path_factory.mktemp("pdrogue")
    store = tmp / "store"
    (p,) = start_all([(worker_args(ckpt, "--role", "prefill", store=store), tmp / "p.log")])
    (d,) = start_all(
        [(worker_args(ckpt, "--role", "decode", "--pd-prefill", p.url), tmp / "d.log")]
    )
    yield {"p": p, "d": d, "store": store, "tmp": tmp}
    for s in (p, d):
        s.stop()


def stored(store: Path) -> set[str]:
    """Every file of the storage directory (its units), by relative path."""
    return {str(f.relative_to(store)) for f in store.rglob("*") if f.is_file()}


def blocks(server: Server) -> dict[str, list[int]]:
    r = httpx.get(f"{server.url}/debug/blocks", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def cold_text(ckpt: Path, prompt: list[int], n: int = 4) -> str:
    return ByteCodec(97).decode(hf_greedy(load_hf(ckpt), prompt, n))


def test_a_peer_without_curve_is_refused_by_default(workers: dict[str, Any], ckpt: Path) -> None:
    p, d = workers["p"], workers["d"]
    pinfo = info(p)
    assert pinfo["curve_public_key"]  # CURVE, though no option named a key
    prompt = [(29 * i + 7) % 97 for i in range(41)]
    before = metrics(p)
    keys = pack_keys(keys_of(pinfo["layout"], prompt)[:4])
    ask = header("handoff", "rogue", layout=pinfo["layout"], tokens=prompt, salt="", keys=keys)
    ch = ZmqTransport().connect(pinfo["transfer_endpoint"], "rogue")  # no CURVE at all
    try:
        ch.send([ask])
        assert ch.recv(2.0) is None  # no refusal, no pull, no page: the handshake failed
    finally:
        ch.close()
    assert metrics(p) == before
    r = complete(d, prompt)  # d, started alongside with no option, is let in
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == cold_text(ckpt, prompt)
    assert d.wait_idle()["ok"] and p.wait_idle()["ok"]


def made_up(page_bytes: int) -> Any:
    """A rogue decode's answer to prefill's pull: random pages under correct checksums."""

    def give(head: dict[str, Any]) -> Frames:
        rng = np.random.default_rng(7)
        n = head["end_page"] - head["first_page"]
        pages = [rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(n)]
        return pulled_message(head["id"], head["first_page"], pages)

    return give


@torch.no_grad()
def test_pages_pulled_from_a_peer_trusted_to_read_serve_that_request_only(
    workers: dict[str, Any], ckpt: Path
) -> None:
    p, d, store = workers["p"], workers["d"], workers["store"]
    pinfo = info(p)
    ep, lay = pinfo["transfer_endpoint"], pinfo["layout"]
    prompt = [(13 * i + 5) % 97 for i in range(41)]  # 6 pages of 8; new to p
    tree, units = blocks(p), stored(store)
    # the rogue holds this user's keys: it claims 4 held pages and answers the pull
    head, _ = raw_handoff(
        ep, prompt, keys_of(lay, prompt)[:4], lay, hid="rogue", pull=made_up(lay["page_bytes"])
    )
    assert head["type"] == "pages" and head["pulls"] == [[0, 4]]
    assert head["computed_tokens"] == 41 - 4 * 8  # that request did use the 4 pages
    assert p.wait_idle()["ok"]
    assert blocks(p) == tree and stored(store) == units  # nothing of it was kept, anywhere
    # the next client of the same prompt: computed from scratch, the cold run's logits
    head, frames = raw_handoff(ep, prompt, [], lay, hid="after")
    assert head["type"] == "pages" and head["pulls"] == [] and head["computed_tokens"] == 41
    got = read_pages(head, frames, lay["page_bytes"])
    ref = load_hf(ckpt)(torch.tensor([prompt])).logits[0, -1].float()
    assert rel_err(torch.from_numpy(got.logits), ref) <= 1e-4
    assert p.wait_idle()["ok"]
    grown = blocks(p)
    assert len(grown["GPU"]) == len(tree["GPU"]) + 5  # honest pages are cached, as ever
    assert stored(store) > units  # and backed up: the store was live all along
    r = complete(d, prompt)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == cold_text(ckpt, prompt)
    assert d.wait_idle()["ok"] and p.wait_idle()["ok"]


def test_a_malformed_handoff_is_refused_and_the_listener_keeps_serving(
    workers: dict[str, Any],
) -> None:
    p = workers["p"]
    pinfo = info(p)
    ep, lay = pinfo["transfer_endpoint"], pinfo["layout"]
    prompt = [(7 * i + 3) % 97 for i in range(17)]
    good = dict(layout=lay, tokens=prompt, salt="", keys=b"")
    bad: list[tuple[str, Any, str]] = [
        ("layout", "x", "layout from decode is a str"),
        ("layout", 5, "layout from decode is a int"),
        ("layout", {**lay, "page_size": "8"}, "page_size"),
        ("layout", {**lay, "tp": True}, "tp"),
        ("tokens", 5, "'tokens': expected list"),
        ("tokens", ["a"], "'tokens': not a list of ints"),
        ("tokens", [97], "'tokens': not a list of ints in [0, 96]"),
        ("tokens", [], "'tokens': the prompt is empty"),
        ("salt", 5, "'salt': expected str"),
        ("keys", "k", "'keys': expected bytes"),
        ("keys", b"\0" * 17, "multiple of 16"),
    ]
    before = metrics(p)
    transport = TRANSPORTS.create("zmq", curve=local_curve())
    ch = transport.connect(ep, "bad", next(iter(transport.curve.peers)))
    try:
        for i, (field, value, why) in enumerate(bad):
            ch.send([header("handoff", f"bad{i}", **{**good, field: value})])
            frames = ch.recv(30.0)
            assert frames is not None, f"no answer to a bad {field} within 30 s"
            head = read_header(frames)
            assert head["type"] == "refused" and why in head["message"], (field, head)
        ch.send([b"\xc1"])  # not msgpack: no id to refuse it by
        ch.send([header("handoff", "")])  # an empty id
        assert ch.recv(1.0) is None
    finally:
        ch.close()
    head, _ = raw_handoff(ep, prompt, [], lay, hid="good")  # the listener still serves
    assert head["type"] == "pages" and head["computed_tokens"] == 17
    assert httpx.get(f"{p.url}/health", timeout=10).status_code == 200
    after = metrics(p)
    assert after[FAILURES] - before.get(FAILURES, 0.0) == 2  # the two with no usable header
    assert after[REFUSED] - before.get(REFUSED, 0.0) == len(bad)
    assert p.wait_idle()["ok"]


def test_a_dead_listener_takes_health_to_503_and_the_server_out(ckpt: Path, tmp_path: Path) -> None:
    p = Server(worker_args(ckpt, "--role", "prefill"), tmp_path / "p.log")
    try:
        r = httpx.post(f"{p.url}/debug/listeners/pd-prefill/kill", timeout=10)
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 10.0
        while (h := httpx.get(f"{p.url}/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 10 s after the kill"
            time.sleep(0.05)
        assert h.status_code == 503 and "pd-prefill" in h.text, h.text
        assert p.proc.wait(60) == 1  # out within a bound, exit 1
    finally:
        p.stop()
    assert "listener thread pd-prefill: ListenerKilled" in (tmp_path / "p.log").read_text()

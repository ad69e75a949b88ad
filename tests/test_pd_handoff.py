"""P/D hand-offs between real workers on 127.0.0.1, with exact page and byte counts: a cold
prompt sends all its pages, a full decode hit only the last, turn 2 only the new pages, a prefix
decode finds in the shared storage directory nothing for those pages; a prefill refuses a layout
mismatch (naming the field), forged keys and a claim on the last prompt token's page; an
unreachable prefill is a 502 naming it. Every worker's pools pass the integrity check after
each step. The workers run --pd-insecure: a relay corrupts the link itself, which CURVE's MAC
would catch before the pages' own checksums (the default, CURVE: tests/test_pd_rogue.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from kvstrata.cache.keys import Namespace, key_hex, page_keys, salted
from kvstrata.memory.layout import KVShape
from kvstrata.serve.codec import ByteCodec
from kvstrata.storage.units import UnitLayout
from tests.pd_helpers import (
    INSECURE,
    PAGE,
    CuttableRelay,
    complete,
    info,
    metrics,
    raw_handoff,
    start_all,
    worker_args,
)
from tests.serve_helpers import Server, refused_port
from tests.tiny_models import hf_greedy, load_hf

PROMPT_A = [(5 * i + 1) % 97 for i in range(41)]  # 41 tokens: 5 full pages + 1 token
PROMPT_B = [(7 * i + 3) % 97 for i in range(41)]


CKPT = {"seed": 2, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The storage directory every worker shares."""
    return tmp_path_factory.mktemp("pd") / "store"


@pytest.fixture(scope="module")
def workers(store: Path, ckpt: Path) -> Iterator[dict[str, Server]]:
    tmp = store.parent
    p = (worker_args(ckpt, INSECURE, "--role", "prefill", store=store), tmp / "p.log")
    servers = start_all([p])
    prefill = servers[0]
    fallback = {1: [], 2: ["--pd-on-failure", "local"]}
    decode = [
        (worker_args(ckpt, INSECURE, "--role", "decode", "--pd-prefill", prefill.url, "--pd-timeout-s",
                     "3", "--pd-trust-request-prefill", *fallback[i], store=store), tmp / f"d{i}.log")
        for i in (1, 2)
    ]  # fmt: skip
    d1, d2 = start_all(decode)
    yield {"p": prefill, "d1": d1, "d2": d2}
    for s in (prefill, d1, d2):
        s.stop()
    for log in tmp.glob("*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()


def pd_usage(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def check_all(workers: dict[str, Server]) -> None:
    for s in workers.values():
        rep = s.wait_idle()
        assert rep["ok"] and rep["accounting"]["device"]["locked"] == 0


def test_info_names_roles_layout_and_endpoint(workers: dict[str, Server]) -> None:
    p, d = info(workers["p"]), info(workers["d1"])
    assert p["role"] == "prefill" and d["role"] == "decode"
    assert p["transfer_endpoint"].startswith("tcp://127.0.0.1:") and d["transfer_endpoint"] == ""
    assert d["prefill"] == [workers["p"].url] and p["layout"] == d["layout"]
    lay = p["layout"]
    assert (lay["page_size"], lay["layers"], lay["kv_heads"], lay["head_dim"]) == (8, 2, 2, 16)
    assert lay["page_bytes"] == 2 * 2 * PAGE * 2 * 16 * 4  # layers x K/V x tokens x heads x dim x 4


def test_cold_full_hit_and_turn_two_send_exactly_the_missing_pages(
    workers: dict[str, Server], ckpt: Path
) -> None:
    page_bytes = info(workers["p"])["layout"]["page_bytes"]
    cold = pd_usage(complete(workers["d1"], PROMPT_A))
    assert cold["pd"]["pages_received"] == 6  # ceil(41 / 8): every page, the partial one too
    assert cold["pd"]["bytes_received"] == 6 * page_bytes
    assert (cold["pd"]["pages_skipped"], cold["pd"]["pages_from_storage"]) == (0, 0)
    assert cold["pd"]["prefill_computed_tokens"] == 41
    check_all(workers)
    hit = complete(workers["d1"], PROMPT_A, max_tokens=8)
    use = pd_usage(hit)
    assert use["pd"]["pages_received"] == 1 and use["pd"]["bytes_received"] == page_bytes
    assert use["pd"]["pages_skipped"] == 5 and use["prompt_tokens_details"]["cached_tokens"] == 40
    assert (
        use["pd"]["prefill_computed_tokens"] == 1
    )  # prefill's own device memory held the other 40
    check_all(workers)
    out = hf_greedy(load_hf(ckpt), PROMPT_A, 8)  # = decode's output (text below)
    assert hit.json()["choices"][0]["text"] == ByteCodec(97).decode(out)
    turn2 = PROMPT_A + out + [(3 * i + 2) % 97 for i in range(20)]  # 69 tokens
    use = pd_usage(complete(workers["d1"], turn2))
    held = (41 + 8 - 1) // PAGE  # decode cached the full pages of turn 1's prompt + output: 6
    new_pages = math.ceil(len(turn2) / PAGE) - held
    assert new_pages == 3
    assert use["pd"]["pages_received"] == new_pages
    assert use["pd"]["bytes_received"] == new_pages * page_bytes
    assert use["pd"]["pages_skipped"] == held
    # prefill's own device memory holds A's 5 pages; the 6th (decode's generated tokens) it takes
    # from the shared storage, where decode backed it up: it computes only what nobody holds
    assert use["pd"]["prefill_computed_tokens"] == len(turn2) - held * PAGE
    check_all(workers)
    pages, nbytes = 6 + 1 + new_pages, (6 + 1 + new_pages) * page_bytes  # the three hand-offs
    for srv, way in ((workers["d1"], "received"), (workers["p"], "sent")):
        m = metrics(srv)
        assert m[f'kvstrata:pd_pages_total{{direction="{way}",model_name="tiny"}}'] == pages
        assert m[f'kvstrata:pd_bytes_total{{direction="{way}",model_name="tiny"}}'] == nbytes
    m = metrics(workers["d1"])
    assert m['kvstrata:pd_pages_skipped_total{model_name="tiny"}'] == 5 + held
    assert m['kvstrata:pd_handoffs_total{model_name="tiny",outcome="ok"}'] == 3


def test_prefix_in_shared_storage_is_not_sent(workers: dict[str, Server]) -> None:
    page_bytes = info(workers["p"])["layout"]["page_bytes"]
    assert pd_usage(complete(workers["d1"], PROMPT_B))["pd"]["pages_received"] == 6
    check_all(workers)  # idle: every storage backup of B is committed
    use = pd_usage(
        complete(workers["d2"], PROMPT_B)
    )  # d2 never saw B: only the shared storage has it
    assert use["pd"]["pages_from_storage"] == 5 and use["pd"]["pages_skipped"] == 5
    assert use["pd"]["pages_received"] == 1 and use["pd"]["bytes_received"] == page_bytes
    assert use["prompt_tokens_details"]["cached_tokens_by_tier"]["storage"] == 40
    check_all(workers)


def test_a_page_decode_fails_to_read_from_shared_storage_is_sent_by_prefill(
    workers: dict[str, Server], ckpt: Path, store: Path
) -> None:
    """Decode claims only the pages its own storage read verified: with page 2 of a stored prefix
    damaged on disk, decode takes pages 0-1 from storage and prefill sends pages 2-5."""
    lay = info(workers["p"])["layout"]
    prompt = [(9 * i + 2) % 97 for i in range(41)]  # 5 full pages + 1 token
    assert pd_usage(complete(workers["d1"], prompt))["pd"]["pages_received"] == 6
    check_all(workers)  # idle: every storage backup of the prompt is committed
    shape = KVShape(lay["layers"], lay["kv_heads"], lay["head_dim"], PAGE, lay["dtype"])
    unit = UnitLayout(shape).unit_key(_keys(lay, prompt)[2], ((0, 1), (0, 1)))
    path = store / key_hex(unit)[:2] / f"{key_hex(unit)}.kvp"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of the payload: the checksum fails, the file is a miss
    path.write_bytes(bytes(data))
    r = complete(
        workers["d2"], prompt
    )  # d2 never saw it: only the shared storage (and prefill) has it
    use = pd_usage(r)
    assert use["pd"]["pages_from_storage"] == 2 and use["pd"]["pages_skipped"] == 2
    assert use["pd"]["pages_received"] == 4  # pages 2..5, from prefill's own cache
    assert r.json()["choices"][0]["text"] == ByteCodec(97).decode(
        hf_greedy(load_hf(ckpt), prompt, 4)
    )
    check_all(workers)


def _keys(layout: dict, tokens: list[int], salt: str = "") -> list[int]:
    ns = salted(Namespace(layout["model"], layout["dtype"], page_size=layout["page_size"]), salt)
    return page_keys(tokens[: len(tokens) // PAGE * PAGE], ns, 97)


def test_prefill_checks_layout_keys_and_the_last_page(workers: dict[str, Server]) -> None:
    pinfo = info(workers["p"])
    ep, lay = pinfo["transfer_endpoint"], pinfo["layout"]
    keys = _keys(lay, PROMPT_A)
    head, frames = raw_handoff(ep, PROMPT_A, keys[:2], lay, hid="ok", insecure=True)
    assert head["type"] == "pages" and head["first_page"] == 2 and len(frames) == 2 + 4
    head, _ = raw_handoff(ep, PROMPT_A, keys[:2], {**lay, "page_size": 16}, hid="ps", insecure=True)
    assert head["type"] == "refused" and head["id"] == "ps"
    assert head["message"].startswith("layout mismatch: page_size is 8 here but 16 on decode")
    head, _ = raw_handoff(
        ep, PROMPT_A, keys[:2], {**lay, "dtype": "bfloat16"}, hid="dt", insecure=True
    )
    assert "layout mismatch: dtype" in head["message"]
    forged = [keys[0], keys[1] ^ 1]
    head, _ = raw_handoff(ep, PROMPT_A, forged, lay, hid="forged", insecure=True)
    assert head["type"] == "refused" and "page 1: decode's key does not match" in head["message"]
    head, _ = raw_handoff(ep, PROMPT_A, keys[:2], lay, salt="tenant-b", hid="salt", insecure=True)
    assert head["type"] == "refused" and "page 0" in head["message"]  # other namespace
    salted = _keys(lay, PROMPT_A, salt="tenant-b")
    head, _ = raw_handoff(
        ep, PROMPT_A, salted[:2], lay, salt="tenant-b", hid="salt-ok", insecure=True
    )
    assert head["type"] == "pages" and head["pulls"] == [[0, 2]]  # answered with no page
    assert head["computed_tokens"] == 41  # so prefill computed them
    whole = PROMPT_A[:40] + [9] * 8  # 48 tokens: 6 full pages, the 6th holds the last token
    head, _ = raw_handoff(ep, whole, _keys(lay, whole), lay, hid="last", insecure=True)
    assert head["type"] == "refused" and "at most 5" in head["message"]
    check_all(workers)


def test_unreachable_prefill_is_a_502_naming_it(workers: dict[str, Server]) -> None:
    """Nothing listens at the endpoint: the refused link fails the hand-off within a heartbeat
    (a 502 saying so), not after the 3 s silence bound (a 504)."""
    before = workers["d1"].wait_idle()["device_free"]
    with refused_port() as port:
        dead = f"tcp://127.0.0.1:{port}"
        t0 = time.monotonic()
        r = complete(workers["d1"], [(11 * i) % 97 for i in range(30)], pd_prefill=dead)
        took = time.monotonic() - t0
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert dead in err["message"] and "unreachable: connection refused" in err["message"]
    assert err["type"] == "BadGatewayError" and took < 10.0
    assert workers["d1"].wait_idle()["device_free"] == before  # its pages came back
    r = complete(workers["d1"], [1, 2, 3], pd_prefill="ftp://x")
    assert r.status_code == 400 and r.json()["error"]["param"] == "pd_prefill"


def test_failed_handoff_prefills_locally_when_asked(workers: dict[str, Server], ckpt: Path) -> None:
    prompt = [(17 * i + 3) % 97 for i in range(30)]
    with refused_port() as port:
        r = complete(workers["d2"], prompt, pd_prefill=f"tcp://127.0.0.1:{port}")  # local fallback
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ByteCodec(97).decode(
        hf_greedy(load_hf(ckpt), prompt, 4)
    )
    assert "pd" not in r.json()["usage"]  # nothing crossed: decode computed it
    assert (
        metrics(workers["d2"])['kvstrata:pd_handoffs_total{model_name="tiny",outcome="failed"}']
        == 1
    )
    check_all(workers)


def test_a_corrupted_page_is_never_used_the_handoff_is_asked_again(
    workers: dict[str, Server], ckpt: Path
) -> None:
    endpoint = info(workers["p"])["transfer_endpoint"]
    prompt = [(19 * i + 2) % 97 for i in range(41)]
    relay = CuttableRelay(endpoint, corrupt=1)  # the first reply arrives with one bit flipped
    try:
        r = complete(workers["d1"], prompt, pd_prefill=relay.endpoint)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ByteCodec(97).decode(
            hf_greedy(load_hf(ckpt), prompt, 4)
        )
        pd = r.json()["usage"]["pd"]
        assert pd["pages_received"] == 6  # all of them, once, intact
        assert pd["prefill_computed_tokens"] == 1  # prefill cached the prompt on the first try
        assert relay.accepted == 2
    finally:
        relay.close()
    m = metrics(workers["d1"])
    assert m['kvstrata:pd_handoffs_total{model_name="tiny",outcome="retried"}'] == 1
    other = [(23 * i + 5) % 97 for i in range(41)]
    relay = CuttableRelay(endpoint, corrupt=2)  # every try corrupted: a clear 502
    try:
        r = complete(workers["d1"], other, pd_prefill=relay.endpoint)
    finally:
        relay.close()
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    assert relay.endpoint in msg and "checksum" in msg
    check_all(workers)

"""Prefill pulls the held pages it lacks from decode, over the hand-off's channel: real workers
on 127.0.0.1 (two prefill workers, one decode, no shared storage). Turn 2 of a session on a prefill
worker that never saw turn 1 pulls exactly decode's held pages and computes only the new tokens;
asked again it hits its own cache. A raw decode-side client checks the logits against
recompute, a corrupted pulled page (recomputed, never used), and a decode that goes silent
mid-pull (prefill's lease ends, every page comes back). Integrity checks after each step.
The workers run --pd-insecure and --pd-trust-pulled: a relay corrupts the link itself, which
CURVE's MAC would catch before the pages' own checksums; and the decode worker is ours."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import torch

from kvstrata.pd.wire import Frames, pulled_message, read_pages
from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import (
    INSECURE,
    PAGE,
    CuttableRelay,
    complete,
    info,
    keys_of,
    metrics,
    raw_handoff,
    start_all,
    worker_args,
)
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf, rel_err

PROMPT = [(5 * i + 1) % 97 for i in range(41)]  # 41 tokens: 5 full pages + 1 token
TIMEOUT_S = 3.0  # the second prefill worker's pd_timeout_s (a silent decode ends its wait)


CKPT = {"seed": 3, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("pdpull")
    slow = ["--pd-timeout-s", str(TIMEOUT_S)]
    trust = "--pd-trust-pulled"  # the decode worker is ours: what it sends may be cached
    p1, p2 = start_all(
        [
            (worker_args(ckpt, INSECURE, "--role", "prefill", trust), tmp / "p1.log"),
            (worker_args(ckpt, INSECURE, "--role", "prefill", trust, *slow), tmp / "p2.log"),
        ]
    )
    pd = ["--pd-prefill", f"{p1.url},{p2.url}", "--pd-trust-request-prefill"]  # + relays
    (d,) = start_all([(worker_args(ckpt, INSECURE, "--role", "decode", *pd), tmp / "d.log")])
    yield {"p1": p1, "p2": p2, "d": d}
    for s in (p1, p2, d):
        s.stop()
    for log in tmp.glob("*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()


def check_all(workers: dict[str, Server]) -> None:
    for s in workers.values():
        rep = s.wait_idle()
        assert rep["ok"] and rep["accounting"]["device"]["locked"] == 0


def pd_of(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["pd"]


def pulled(server: Server, direction: str) -> tuple[float, float]:
    """(pages, bytes) the worker counted under `direction` ("pull_sent" / "pull_received")."""
    m, lbl = metrics(server), f'direction="{direction}",model_name="tiny"'
    return m.get(f"kvstrata:pd_pages_total{{{lbl}}}", 0.0), m.get(
        f"kvstrata:pd_bytes_total{{{lbl}}}", 0.0
    )


def test_turn_two_on_a_fresh_prefill_pulls_exactly_what_decode_holds(
    workers: dict[str, Server], ckpt: Path
) -> None:
    p1, p2, d = workers["p1"], workers["p2"], workers["d"]
    page_bytes, hf = info(p1)["layout"]["page_bytes"], load_hf(ckpt)
    out = hf_greedy(hf, PROMPT, 8)
    r = complete(d, PROMPT, max_tokens=8, pd_prefill=p1.url)  # turn 1: prefill worker 1
    assert pd_of(r)["pages_pulled"] == 0 and r.json()["choices"][0]["text"] == ByteCodec(97).decode(
        out
    )
    check_all(workers)
    turn2 = PROMPT + out + [(3 * i + 2) % 97 for i in range(20)]  # 69 tokens
    held = (41 + 8 - 1) // PAGE  # decode cached turn 1's prompt and output: 6 full pages
    r = complete(d, turn2, max_tokens=6, pd_prefill=p2.url)  # worker 2 never saw turn 1
    pd = pd_of(r)
    assert (pd["pages_pulled"], pd["bytes_pulled"]) == (held, held * page_bytes)
    assert pd["pages_pulled_kept"] == held
    assert pd["pages_skipped"] == held and pd["pages_received"] == math.ceil(69 / PAGE) - held
    assert pd["prefill_computed_tokens"] == len(turn2) - held * PAGE  # only the new tokens
    out2 = hf_greedy(hf, turn2, 6)
    assert r.json()["choices"][0]["text"] == ByteCodec(97).decode(out2)
    assert pulled(p2, "pull_received") == (held, held * page_bytes)
    assert pulled(d, "pull_sent") == (held, held * page_bytes)
    assert pulled(p1, "pull_received") == (0, 0)
    check_all(workers)
    r = complete(d, turn2, max_tokens=6, pd_prefill=p2.url)  # asked again: its own cache
    pd = pd_of(r)
    assert pd["pages_pulled"] == 0 and pd["pages_skipped"] == 8 and pd["pages_received"] == 1
    assert pd["prefill_computed_tokens"] == len(turn2) - 8 * PAGE
    assert r.json()["choices"][0]["text"] == ByteCodec(97).decode(out2)
    turn3 = turn2 + out2 + [(11 * i + 5) % 97 for i in range(9)]  # 84 tokens
    r = complete(d, turn3, max_tokens=4, pd_prefill=p2.url)
    pd = pd_of(r)
    # decode holds 9 pages (turn 2's prompt and output); prefill its own 8: one page crosses
    assert (pd["pages_pulled"], pd["bytes_pulled"]) == (1, page_bytes)
    assert pd["prefill_computed_tokens"] == len(turn3) - 9 * PAGE
    assert r.json()["choices"][0]["text"] == ByteCodec(97).decode(hf_greedy(hf, turn3, 4))
    assert pulled(p2, "pull_received") == (held + 1, (held + 1) * page_bytes)
    check_all(workers)


def test_a_pulled_page_corrupted_on_the_link_is_recomputed(
    workers: dict[str, Server], ckpt: Path
) -> None:
    p1, p2, d = workers["p1"], workers["p2"], workers["d"]
    hf, page_bytes = load_hf(ckpt), info(p2)["layout"]["page_bytes"]
    prompt = [(37 * i + 8) % 97 for i in range(41)]
    out = hf_greedy(hf, prompt, 8)
    assert pd_of(complete(d, prompt, max_tokens=8, pd_prefill=p1.url))["pages_pulled"] == 0
    turn2 = prompt + out + [(3 * i + 2) % 97 for i in range(20)]  # 69 tokens, 6 pages held
    before = pulled(p2, "pull_received")
    # decode -> prefill on this link: greeting + hand-off (537 bytes), the pulled reply's
    # header, then 6 frames of page_bytes + 9: byte 10900 lies deep inside the third page
    assert page_bytes == 4096
    relay = CuttableRelay(info(p2)["transfer_endpoint"], corrupt=1, at=10900, upward=True)
    try:
        r = complete(d, turn2, max_tokens=6, pd_prefill=relay.endpoint)
    finally:
        relay.close()
    pd = pd_of(r)
    assert (pd["pages_pulled"], pd["bytes_pulled"]) == (6, 6 * page_bytes)  # all sent
    assert pd["pages_pulled_kept"] == 2  # the third failed its checksum: never used
    assert pd["prefill_computed_tokens"] == len(turn2) - 2 * PAGE  # page 2 on: computed
    out2 = hf_greedy(hf, turn2, 6)
    assert r.json()["choices"][0]["text"] == ByteCodec(97).decode(out2)
    got = pulled(p2, "pull_received")
    assert (got[0] - before[0], got[1] - before[1]) == (2, 2 * page_bytes)  # 2 intact, used
    check_all(workers)
    r = complete(d, turn2, max_tokens=6, pd_prefill=p2.url)  # its own cache now
    assert pd_of(r)["pages_pulled"] == 0 and pd_of(r)["prefill_computed_tokens"] == 5
    assert r.json()["choices"][0]["text"] == ByteCodec(97).decode(out2)
    check_all(workers)


def _source_pages(workers: dict[str, Server], prompt: list[int]) -> list[Any]:
    """Every page of `prompt` as prefill worker 1 computes it (what a decode would hold)."""
    lay = info(workers["p1"])["layout"]
    head, frames = raw_handoff(
        info(workers["p1"])["transfer_endpoint"], prompt, [], lay, insecure=True
    )
    return read_pages(head, frames, lay["page_bytes"]).pages


@torch.no_grad()
def test_pulled_pages_give_recompute_logits_and_a_corrupted_one_is_recomputed(
    workers: dict[str, Server], ckpt: Path
) -> None:
    p2 = info(workers["p2"])
    ep, lay, hf = p2["transfer_endpoint"], p2["layout"], load_hf(ckpt)
    before = pulled(workers["p2"], "pull_received")[0]
    for bad, prompt in ((None, [(29 * i + 4) % 97 for i in range(41)]), (2, PROMPT[::-1])):
        src = _source_pages(workers, prompt)

        def give(head: dict[str, Any], bad: int | None = bad, src: list[Any] = src) -> Frames:
            msg = pulled_message(
                head["id"], head["first_page"], src[head["first_page"] : head["end_page"]]
            )
            if bad is not None:  # one bit of page `bad` flipped after its checksum was taken
                page = bytearray(msg[1 + bad])
                page[100] ^= 0x10
                msg[1 + bad] = bytes(page)
            return msg

        keys = keys_of(lay, prompt)
        head, frames = raw_handoff(
            ep, prompt, keys, lay, hid=f"pull{bad}", pull=give, insecure=True
        )
        assert head["type"] == "pages" and head["pulls"] == [[0, 5]]
        kept = 5 if bad is None else bad  # the bad page and the ones after it are computed
        assert head["computed_tokens"] == len(prompt) - kept * PAGE
        got = read_pages(head, frames, lay["page_bytes"])
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        assert rel_err(torch.from_numpy(got.logits), ref) <= 1e-4
        assert pulled(workers["p2"], "pull_received")[0] == before + kept
        before += kept
        check_all(workers)
        head, _ = raw_handoff(
            ep, prompt, keys, lay, hid=f"again{bad}", insecure=True
        )  # its own cache now
        assert head["pulls"] == [] and head["computed_tokens"] == 1
        check_all(workers)


def test_a_decode_silent_mid_pull_ends_the_lease_and_frees_every_page(
    workers: dict[str, Server],
) -> None:
    p2 = info(workers["p2"])
    free = workers["p2"].wait_idle()["device_free"]
    prompt = [(31 * i + 6) % 97 for i in range(33)]
    t0 = time.monotonic()
    head, _ = raw_handoff(
        p2["transfer_endpoint"], prompt, keys_of(p2["layout"], prompt), p2["layout"],
        hid="silent", pull=lambda head: None, insecure=True,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert head["type"] == "refused" and head["pulls"] == [[0, 4]]
    assert f"pd_timeout_s={TIMEOUT_S} for held pages [0, 4) pulled from decode" in head["message"]
    assert TIMEOUT_S <= took < TIMEOUT_S + 3
    rep = workers["p2"].wait_idle()
    assert rep["ok"] and rep["device_free"] == free  # nothing of it stays held or cached
    check_all(workers)
    r = complete(workers["d"], prompt, pd_prefill=workers["p2"].url)  # the next one succeeds
    assert pd_of(r)["pages_received"] == 5
    check_all(workers)

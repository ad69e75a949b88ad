"""Prefill on two real gloo ranks pulls the held pages it lacks from decode's two ranks: rank r
of prefill asks rank r of decode for its own part of each page (its KV head under --tp 2, its
stage's layer under --pp 2) over the pair's channel. Turn 2 of a session on a prefill worker that never saw turn 1 pulls exactly
decode's pages (per rank: pages x its part's bytes) and computes only the new tokens on every
rank; greedy tokens equal a single server's; asked again it pulls nothing. Raw decode-side
clients check the first-token logits after a pull against recompute (fp32, <= 1e-4), a page
corrupted on one rank only (every rank computes from it), and one silent decode rank (the
request fails on every rank within pd_timeout_s naming the pages and the rank; nothing leaks)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.pd.wire import Frames, pulled_message, read_pages
from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import (
    PAGE,
    both_parts,
    both_ranks,
    complete,
    info,
    keys_of,
    metrics,
    ranks,
    ranks_parts,
    start_all,
    worker_args,
)
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf, rel_err

pytestmark = pytest.mark.slow  # three workers on two ranks each + a single server

LAYOUTS = {"tp": ["--tp", "2"], "pp": ["--pp", "2"]}
TIMEOUT_S = 3.0  # prefill worker b's pd_timeout_s (a silent decode rank ends its wait)


CKPT = {"seed": 5, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module", params=list(LAYOUTS))
def workers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, ckpt: Path
) -> Iterator[dict[str, Any]]:
    """Prefill workers a and b (b: a short pd_timeout_s), a decode worker, all on 2 ranks."""
    kind, tmp = request.param, tmp_path_factory.mktemp(f"pull-{request.param}")
    lay = LAYOUTS[kind]
    slow = ["--pd-timeout-s", str(TIMEOUT_S)]
    pa, pb = start_all(
        [
            (worker_args(ckpt, "--role", "prefill", "--pd-trust-pulled", *lay), tmp / "pa.log"),
            (
                worker_args(ckpt, "--role", "prefill", "--pd-trust-pulled", *slow, *lay),
                tmp / "pb.log",
            ),
        ]
    )
    d, single = start_all(
        [
            (
                worker_args(ckpt, "--role", "decode", "--pd-prefill", f"{pa.url},{pb.url}", *lay),
                tmp / "d.log",
            ),
            (worker_args(ckpt), tmp / "s.log"),
        ]
    )
    yield {"pa": pa, "pb": pb, "d": d, "single": single, "kind": kind}
    for s in (pa, pb, d, single):
        s.stop()
    for log in tmp.glob("*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()


def check_all(workers: dict[str, Any]) -> None:
    for name in ("pa", "pb", "d", "single"):
        rep = workers[name].wait_idle()
        assert rep["ok"] and rep["accounting"]["device"]["locked"] == 0


def counts(server: Server, *names: str) -> list[tuple[int, ...]]:
    """Per rank: the named counters of GET /v1/pd/ranks."""
    return [tuple(r[n] for n in names) for r in ranks(server)]


def rise(before: list[tuple[int, ...]], after: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Per rank: how much each counter rose."""
    pairs = zip(before, after, strict=True)
    return [tuple(b - a for a, b in zip(x, y, strict=True)) for x, y in pairs]


PULLED_IN = ("pages_pull_received", "bytes_pull_received", "prompt_tokens_computed")


def test_turn_two_on_a_fresh_prefill_pulls_each_ranks_part(
    workers: dict[str, Any], ckpt: Path
) -> None:
    pa, pb, d, single = (workers[k] for k in ("pa", "pb", "d", "single"))
    lay, parts = info(pb)["layout"], [p[1] for p in ranks_parts(info(pb))]
    hf, codec = load_hf(ckpt), ByteCodec(97)
    prompt = [(5 * i + 1) % 97 for i in range(41)]
    out = hf_greedy(hf, prompt, 8)
    r = complete(d, prompt, max_tokens=8, pd_prefill=pa.url)  # turn 1: prefill worker a
    assert r.status_code == 200 and r.json()["usage"]["pd"]["pages_pulled"] == 0
    turn2 = prompt + out + [(3 * i + 2) % 97 for i in range(20)]  # 69 tokens, 9 pages
    held = (41 + 8 - 1) // PAGE  # decode cached turn 1's prompt and output: 6 full pages
    pb0, d0 = counts(pb, *PULLED_IN, "bytes_sent"), counts(d, "pages_pull_sent", "bytes_pull_sent")
    r = complete(d, turn2, max_tokens=6, pd_prefill=pb.url)  # worker b never saw turn 1
    assert r.status_code == 200, r.text
    pd = r.json()["usage"]["pd"]
    assert (pd["pages_pulled"], pd["bytes_pulled"]) == (held, held * lay["page_bytes"])
    assert pd["pages_pulled_kept"] == held and pd["pages_received"] == 9 - held
    assert pd["prefill_computed_tokens"] == len(turn2) - held * PAGE  # only the new tokens
    want = codec.decode(hf_greedy(hf, turn2, 6))
    assert r.json()["choices"][0]["text"] == want
    assert complete(single, turn2, max_tokens=6).json()["choices"][0]["text"] == want
    new = len(turn2) - held * PAGE
    # every rank: its part of the 6 held pages in, only the new tokens computed, 3 pages out
    assert rise(pb0, counts(pb, *PULLED_IN, "bytes_sent")) == [
        (held, held * part, new, (9 - held) * part) for part in parts
    ]
    assert rise(d0, counts(d, "pages_pull_sent", "bytes_pull_sent")) == [
        (held, held * part) for part in parts
    ]
    # /metrics (rank 0 forwards whole pages): what prefill used, what decode sent
    for server, direction in ((pb, "pull_received"), (d, "pull_sent")):
        lbl = f'{{direction="{direction}",model_name="tiny"}}'
        m = metrics(server)
        got = (m[f"kvstrata:pd_pages_total{lbl}"], m[f"kvstrata:pd_bytes_total{lbl}"])
        assert got == (held, held * lay["page_bytes"])
    check_all(workers)
    pb1 = counts(pb, *PULLED_IN)
    r = complete(d, turn2, max_tokens=6, pd_prefill=pb.url)  # asked again: its own cache
    pd = r.json()["usage"]["pd"]
    assert pd["pages_pulled"] == 0 and pd["prefill_computed_tokens"] == len(turn2) - 8 * PAGE
    assert r.json()["choices"][0]["text"] == want
    assert rise(pb1, counts(pb, *PULLED_IN)) == [(0, 0, len(turn2) - 8 * PAGE)] * 2
    check_all(workers)


def giver(src: Any, bad: int | None = None) -> Any:
    """A decode rank's answer to a pull: its part of the asked pages (page `bad`: one bit
    flipped after its checksum was taken)."""

    def give(head: dict[str, Any]) -> Frames:
        msg = pulled_message(
            head["id"],
            head["first_page"],
            src.pages[head["first_page"] :][: head["end_page"] - head["first_page"]],
        )
        if bad is not None:
            page = bytearray(msg[1 + bad])
            page[100] ^= 0x10
            msg[1 + bad] = bytes(page)
        return msg

    return give


@torch.no_grad()
def test_pulled_parts_give_recompute_logits_and_a_page_bad_on_one_rank_is_computed_by_all(
    workers: dict[str, Any], ckpt: Path
) -> None:
    pb, hf = info(workers["pb"]), load_hf(ckpt)
    lay, parts = pb["layout"], ranks_parts(pb)
    for bad, prompt in (
        (None, [(29 * i + 4) % 97 for i in range(41)]),
        (2, [(13 * i + 7) % 97 for i in range(41)]),
    ):
        src = both_parts(info(workers["pa"]), prompt, f"src{bad}")  # every rank's part, cold
        before = counts(workers["pb"], *PULLED_IN)
        pulls = [giver(src[0]), giver(src[1], bad)]  # only decode rank 1's page is bad
        got = both_ranks(pb, prompt, f"pull{bad}", keys_of(lay, prompt), pulls)
        kept = 5 if bad is None else bad  # the bad page and the ones after it: every rank
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        for r, (head, frames) in enumerate(got):
            assert head["type"] == "pages" and head["pulls"] == [[0, 5]]
            assert head["computed_tokens"] == len(prompt) - kept * PAGE
            row = read_pages(head, frames, parts[r][1]).logits
            assert rel_err(torch.from_numpy(row), ref) <= 1e-4
        computed = len(prompt) - kept * PAGE
        assert rise(before, counts(workers["pb"], *PULLED_IN)) == [
            (kept, kept * part, computed) for _, part in parts
        ]
        check_all(workers)
        again = both_ranks(pb, prompt, f"again{bad}", keys_of(lay, prompt))  # its own cache
        assert [(h["pulls"], h["computed_tokens"]) for h, _ in again] == [([], 1)] * 2
        check_all(workers)


def test_a_silent_decode_rank_fails_the_request_on_every_rank(
    workers: dict[str, Any],
) -> None:
    pb = info(workers["pb"])
    free = workers["pb"].wait_idle()["device_free"]
    prompt = [(31 * i + 6) % 97 for i in range(33)]  # 4 pages held
    src = both_parts(info(workers["pa"]), prompt, "src-silent")
    t0 = time.monotonic()
    got = both_ranks(
        pb, prompt, "silent", keys_of(pb["layout"], prompt), [giver(src[0]), lambda h: None]
    )
    took = time.monotonic() - t0
    for head, _ in got:  # both decode ranks hear why, from their own prefill rank
        assert head["type"] == "refused" and head["pulls"] == [[0, 4]]
        assert (
            f"pd_timeout_s={TIMEOUT_S} for held pages [0, 4) pulled from decode rank 1; none came"
            in head["message"]
        )
    assert TIMEOUT_S <= took < TIMEOUT_S + 3
    rep = workers["pb"].wait_idle()
    assert rep["ok"] and rep["device_free"] == free  # nothing of it stays held or cached
    check_all(workers)
    r = complete(workers["d"], prompt, pd_prefill=workers["pb"].url)  # the next one succeeds
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["pd"]["pages_received"] == 5
    check_all(workers)

"""P/D workers on two real gloo ranks each (--tp 2, and --pp 2): rank r of decode talks to rank
r of prefill and each rank moves only its own part of every page (its KV head under TP, its
layer under PP). The first-token logits of every rank and each rank's pages equal transformers'
forward (fp32, rel err <= 1e-4); greedy tokens equal a one-rank single server's and
transformers'; the bytes each rank sends and receives are exact (a cold prompt: all its pages;
turn 2: only the new ones); a layout mismatch (tp, pp, rank) is refused naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import (
    PAGE,
    both_parts,
    complete,
    info,
    ranks,
    raw_handoff,
    start_all,
    worker_args,
)
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf, rel_err

pytestmark = pytest.mark.slow  # five servers, nine processes (48 s here, more on a loaded box)

LAYOUTS = {"tp": ["--tp", "2"], "pp": ["--pp", "2"]}
PROMPT = [(5 * i + 1) % 97 for i in range(41)]
HEADS, DIM = 2, 16  # the tiny llama: 2 layers, 2 KV heads of 16


CKPT = {"seed": 4, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("pdranks")
    pre = [
        (worker_args(ckpt, "--role", "prefill", *a), tmp / f"p{k}.log") for k, a in LAYOUTS.items()
    ]
    prefill = dict(zip(LAYOUTS, start_all(pre), strict=True))
    dec = [
        (
            worker_args(
                ckpt,
                "--role",
                "decode",
                "--pd-prefill",
                prefill[k].url,
                *a,
                "--pd-trust-request-prefill",
            ),
            tmp / f"d{k}.log",
        )
        for k, a in LAYOUTS.items()
    ]
    started = start_all([*dec, (worker_args(ckpt), tmp / "s.log")])
    out = {f"p{k}": prefill[k] for k in LAYOUTS}
    out.update({f"d{k}": s for k, s in zip(LAYOUTS, started, strict=False)})
    out["single"] = started[-1]
    yield out
    for s in out.values():
        s.stop()


@pytest.mark.parametrize("kind", list(LAYOUTS))
@torch.no_grad()
def test_every_ranks_logits_and_kv_part_equal_recompute(
    servers: dict[str, Server], ckpt: Path, kind: str
) -> None:
    pinfo = info(servers[f"p{kind}"])
    assert len(pinfo["transfer_endpoints"]) == 2 and pinfo["layout"][kind] == 2
    ref = load_hf(ckpt)(torch.tensor([PROMPT]), use_cache=True)
    n, pages = len(PROMPT), -(-len(PROMPT) // PAGE)
    for r, got in enumerate(both_parts(pinfo, PROMPT, f"lg-{kind}")):
        assert rel_err(torch.from_numpy(got.logits), ref.logits[0, -1].float()) <= 1e-4
        assert len(got.pages) == pages
        layers, heads = (2, 1) if kind == "tp" else (1, HEADS)
        kv = torch.from_numpy(np.concatenate([np.frombuffer(p, np.float32) for p in got.pages]))
        kv = kv.view(pages, layers, 2, PAGE, heads, DIM)  # [page, layer, K/V, token, head, dim]
        kv = kv.permute(1, 2, 4, 0, 3, 5).reshape(layers, 2, heads, -1, DIM)[:, :, :, :n]
        for i in range(layers):
            layer = i if kind == "tp" else r  # a pp rank holds its stage's layer
            want = ref.past_key_values.layers[layer]
            hk, hv = want.keys[0], want.values[0]  # [heads, tokens, dim]
            if kind == "tp":
                hk, hv = hk[r : r + 1], hv[r : r + 1]  # a tp rank holds its KV head
            assert rel_err(kv[i, 0], hk) <= 1e-4 and rel_err(kv[i, 1], hv) <= 1e-4
    assert servers[f"p{kind}"].wait_idle()["ok"]


def sent_received(servers: dict[str, Server], kind: str) -> list[tuple[int, int, int]]:
    """Per rank: (bytes prefill rank r sent, bytes decode rank r received, its part's bytes)."""
    p, d = ranks(servers[f"p{kind}"]), ranks(servers[f"d{kind}"])
    assert [x["part_page_bytes"] for x in p] == [x["part_page_bytes"] for x in d]
    return [
        (a["bytes_sent"], b["bytes_received"], a["part_page_bytes"])
        for a, b in zip(p, d, strict=True)
    ]


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_greedy_tokens_and_exact_bytes_per_rank(
    servers: dict[str, Server], ckpt: Path, kind: str
) -> None:
    hf, codec = load_hf(ckpt), ByteCodec(97)
    prompt = [(7 * i + 3 + len(kind)) % 97 for i in range(41)]
    out = hf_greedy(hf, prompt, 12)
    turn2 = prompt + out + [(3 * i + 1) % 97 for i in range(20)]  # 73 tokens: 10 pages
    held = (len(prompt) + len(out) - 1) // PAGE  # decode cached the full pages of turn 1's KV
    for tokens, received, skipped in [(prompt, 6, 0), (turn2, -(-len(turn2) // PAGE) - held, held)]:
        before = sent_received(servers, kind)
        r = complete(servers[f"d{kind}"], tokens, max_tokens=12)
        assert r.status_code == 200, r.text
        want = codec.decode(hf_greedy(hf, tokens, 12))
        assert r.json()["choices"][0]["text"] == want
        single = complete(servers["single"], tokens, max_tokens=12)
        assert single.json()["choices"][0]["text"] == want
        pd = r.json()["usage"]["pd"]
        assert (pd["pages_received"], pd["pages_skipped"]) == (received, skipped)
        assert pd["bytes_received"] == received * info(servers[f"p{kind}"])["layout"]["page_bytes"]
        after = sent_received(servers, kind)
        for (s0, r0, part), (s1, r1, _) in zip(before, after, strict=True):
            assert s1 - s0 == r1 - r0 == received * part  # only the pages decode lacked
    assert received == 4  # turn 2: 10 pages, 6 held by decode
    for name in (f"p{kind}", f"d{kind}", "single"):
        assert servers[name].wait_idle()["ok"]


def test_layout_mismatch_is_refused_naming_the_field(servers: dict[str, Server]) -> None:
    pinfo = info(servers["ptp"])
    lay, ep = pinfo["layout"], pinfo["transfer_endpoints"]
    for endpoint, theirs, field in [
        (ep[0], {**lay, "tp": 1}, "tp"),
        (ep[0], {**lay, "pp": 2}, "pp"),
        (ep[1], {**lay, "rank": 0}, "rank"),  # rank 0 of decode asked rank 1 of prefill
    ]:
        head, _ = raw_handoff(endpoint, PROMPT, [], theirs, hid=f"bad-{field}")
        assert head["type"] == "refused" and f"layout mismatch: {field} is" in head["message"]
    # a real TP=2 decode worker asking the PP=2 prefill worker: refused at the first handshake
    r = complete(servers["dtp"], PROMPT, pd_prefill=servers["ppp"].url)
    assert r.status_code == 502, r.text
    assert "layout mismatch: tp is 1 here but 2 on decode" in r.json()["error"]["message"]
    for name in ("ptp", "ppp", "dtp"):
        assert servers[name].wait_idle()["ok"]

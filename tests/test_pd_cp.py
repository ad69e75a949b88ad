"""P/D workers on two real gloo context-parallel ranks each (--cp 2): a cp rank owns whole pages
(owner = device page id % cp), so prefill rank r sends decode rank r exactly the pages decode
rank r owns (decode names each missing page's owner in its hand-off), whole. The first-token
logits of every prefill rank and every page equal transformers' forward (fp32, rel err
<= 1e-4); greedy tokens equal a one-rank single server's and transformers'; each rank's bytes
are exact (its pages x page bytes, cold and on turn 2); cp on one side only is refused naming
`cp`, and a cp hand-off without owners is refused naming them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.pd.wire import Received, read_pages
from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import PAGE, complete, info, ranks, raw_handoff, start_all, worker_args
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf, rel_err

pytestmark = pytest.mark.slow  # three servers, seven processes

CP = ["--cp", "2"]
PROMPT = [(5 * i + 1) % 97 for i in range(41)]  # 6 pages of 8
LAYERS, HEADS, DIM = 2, 2, 16  # the tiny llama


CKPT = {"seed": 4, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("pdcp")
    (pre,) = start_all([(worker_args(ckpt, "--role", "prefill", *CP), tmp / "p.log")])
    dec = worker_args(ckpt, "--role", "decode", "--pd-prefill", pre.url, *CP)
    d, single = start_all([(dec, tmp / "d.log"), (worker_args(ckpt), tmp / "s.log")])
    out = {"p": pre, "d": d, "single": single}
    yield out
    for s in out.values():
        s.stop()


def both_cp_ranks(pinfo: dict, prompt: list[int], hid: str, owners: list[int]) -> list[Received]:
    """A cold hand-off asked of both prefill ranks at once, as decode's two cp ranks would
    (`owners`: decode's owning rank of each page): each rank's verified reply."""
    lay, got = pinfo["layout"], [None, None]

    def one(r: int) -> None:
        head, frames = raw_handoff(
            pinfo["transfer_endpoints"][r], prompt, [], {**lay, "rank": r}, hid=hid,
            extra={"owners": owners},
        )  # fmt: skip
        assert head["type"] == "pages", head
        got[r] = read_pages(head, frames, lay["page_bytes"])  # type: ignore[call-overload]

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got  # type: ignore[return-value]


@torch.no_grad()
def test_every_ranks_logits_and_pages_equal_recompute(servers: dict[str, Server], ckpt: Path):
    pinfo = info(servers["p"])
    assert len(pinfo["transfer_endpoints"]) == 2 and pinfo["layout"]["cp"] == 2
    ref = load_hf(ckpt)(torch.tensor([PROMPT]), use_cache=True)
    owners = [0, 0, 1, 0, 1, 1]  # any split: decode's page ids decide it
    for r, got in enumerate(both_cp_ranks(pinfo, PROMPT, "lg-cp", owners)):
        assert rel_err(torch.from_numpy(got.logits), ref.logits[0, -1].float()) <= 1e-4
        want = [i for i, o in enumerate(owners) if o == r]
        assert got.stats["cp_pages"] == want and len(got.pages) == len(want) == 3
        assert got.stats["computed_tokens"] == len(PROMPT)
        for i, page in zip(want, got.pages, strict=True):
            kv = torch.from_numpy(np.frombuffer(page, np.float32).copy())
            kv = kv.view(LAYERS, 2, PAGE, HEADS, DIM)[:, :, : len(PROMPT) - i * PAGE]
            for layer in range(LAYERS):
                hk = ref.past_key_values.layers[layer].keys[0]  # [heads, tokens, dim]
                hv = ref.past_key_values.layers[layer].values[0]
                span = slice(i * PAGE, i * PAGE + kv.shape[2])
                assert rel_err(kv[layer, 0].transpose(0, 1), hk[:, span]) <= 1e-4
                assert rel_err(kv[layer, 1].transpose(0, 1), hv[:, span]) <= 1e-4
    assert servers["p"].wait_idle()["ok"]


def sent_received(servers: dict[str, Server]) -> list[tuple[int, int]]:
    """Per rank: (bytes prefill rank r sent, bytes decode rank r received)."""
    p, d = ranks(servers["p"]), ranks(servers["d"])
    return [(a["bytes_sent"], b["bytes_received"]) for a, b in zip(p, d, strict=True)]


def test_greedy_tokens_and_exact_bytes_per_rank(servers: dict[str, Server], ckpt: Path) -> None:
    hf, codec = load_hf(ckpt), ByteCodec(97)
    page_bytes = info(servers["p"])["layout"]["page_bytes"]  # a whole page: a cp rank's unit
    prompt = [(7 * i + 5) % 97 for i in range(41)]
    out = hf_greedy(hf, prompt, 12)
    turn2 = prompt + out + [(3 * i + 1) % 97 for i in range(20)]  # 73 tokens: 10 pages
    held = (len(prompt) + len(out) - 1) // PAGE  # decode cached the full pages of turn 1's KV
    for tokens, received, skipped in [(prompt, 6, 0), (turn2, 4, held)]:
        before = sent_received(servers)
        r = complete(servers["d"], tokens, max_tokens=12)
        assert r.status_code == 200, r.text
        want = codec.decode(hf_greedy(hf, tokens, 12))
        assert r.json()["choices"][0]["text"] == want
        single = complete(servers["single"], tokens, max_tokens=12)
        assert single.json()["choices"][0]["text"] == want
        pd = r.json()["usage"]["pd"]
        assert (pd["pages_received"], pd["pages_skipped"]) == (received, skipped)
        assert pd["bytes_received"] == received * page_bytes
        after = sent_received(servers)
        # decode allocates round robin over its cp shards: each rank owns half the new pages,
        # and exactly those cross on its pair's channel
        for (s0, r0), (s1, r1) in zip(before, after, strict=True):
            assert s1 - s0 == r1 - r0 == received // 2 * page_bytes
        for name in servers:
            rep = servers[name].wait_idle()
            assert rep["ok"], rep
    assert held == 6


def test_cp_on_one_side_or_no_owners_is_refused(servers: dict[str, Server]) -> None:
    pinfo = info(servers["p"])
    lay, ep = pinfo["layout"], pinfo["transfer_endpoints"]
    head, _ = raw_handoff(ep[0], PROMPT, [], {**lay, "cp": 1}, hid="bad-cp")
    assert head["type"] == "refused"
    assert "layout mismatch: cp is 2 here but 1 on decode" in head["message"], head
    head, _ = raw_handoff(ep[0], PROMPT, [], lay, hid="no-owners")
    assert head["type"] == "refused" and "`owners`" in head["message"], head
    head, _ = raw_handoff(ep[0], PROMPT, [], lay, hid="bad-owners", extra={"owners": [0, 2]})
    assert head["type"] == "refused" and "`owners`" in head["message"], head
    assert servers["p"].wait_idle()["ok"]

"""P/D against recompute: the first-token logits row and the KV pages a prefill worker sends equal
transformers' own forward (fp32, rel err <= 1e-4), and the greedy tokens of a decode worker
equal a single server's and transformers' from-scratch greedy decode, cold and on a decode hit."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.pd.wire import read_header, read_pages
from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import PAGE, complete, info, raw_handoff, start_all, worker_args
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf, rel_err

PROMPTS = [[(5 * i + 1) % 97 for i in range(41)], [(13 * i + 7) % 97 for i in range(27)]]


CKPT = {"seed": 4, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("pd")
    (p,) = start_all([(worker_args(ckpt, "--role", "prefill"), tmp / "p.log")])
    d, s = start_all(
        [
            (worker_args(ckpt, "--role", "decode", "--pd-prefill", p.url), tmp / "d.log"),
            (worker_args(ckpt), tmp / "s.log"),
        ]
    )
    yield {"p": p, "d": d, "s": s}
    for x in (p, d, s):
        x.stop()


@torch.no_grad()
def test_first_token_logits_and_kv_pages_equal_recompute(
    servers: dict[str, Server], ckpt: Path
) -> None:
    pinfo = info(servers["p"])
    lay = pinfo["layout"]
    hf = load_hf(ckpt)
    for i, prompt in enumerate(PROMPTS):
        head, frames = raw_handoff(pinfo["transfer_endpoint"], prompt, [], lay, hid=f"lg{i}")
        assert head["layer_messages"] == 2  # one per layer, sent as each was computed
        got = read_pages(head, frames, lay["page_bytes"])
        ref = hf(torch.tensor([prompt]), use_cache=True)
        assert rel_err(torch.from_numpy(got.logits), ref.logits[0, -1].float()) <= 1e-4
        n = len(prompt)
        kv = torch.from_numpy(np.concatenate([np.frombuffer(p, np.float32) for p in got.pages]))
        kv = kv.view(len(got.pages), 2, 2, PAGE, 2, 16)  # [page, layer, K/V, token, head, dim]
        kv = kv.permute(1, 2, 4, 0, 3, 5).reshape(2, 2, 2, -1, 16)[:, :, :, :n]
        for layer in range(2):
            hk = ref.past_key_values.layers[layer].keys[0]  # [heads, tokens, dim]
            hv = ref.past_key_values.layers[layer].values[0]
            assert rel_err(kv[layer, 0], hk) <= 1e-4 and rel_err(kv[layer, 1], hv) <= 1e-4
    assert read_header(frames)["computed_tokens"] == len(PROMPTS[-1])


def test_pd_greedy_tokens_equal_single_server_and_recompute(
    servers: dict[str, Server], ckpt: Path
) -> None:
    hf = load_hf(ckpt)
    for prompt in PROMPTS:
        want = ByteCodec(97).decode(hf_greedy(hf, prompt, 12))
        for _ in range(2):  # cold, then a decode hit (only the last page crosses)
            r = complete(servers["d"], prompt, max_tokens=12)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        single = complete(servers["s"], prompt, max_tokens=12)
        assert single.json()["choices"][0]["text"] == want
        assert r.json()["usage"]["pd"]["pages_skipped"] == (len(prompt) - 1) // PAGE
    for srv in servers.values():
        assert srv.wait_idle()["ok"]


def test_concurrent_handoffs_each_get_their_own_pages(
    servers: dict[str, Server], ckpt: Path
) -> None:
    hf = load_hf(ckpt)
    prompts = [[(k * i + 2 * k + 1) % 97 for i in range(20 + 3 * k)] for k in range(1, 6)]
    want = [ByteCodec(97).decode(hf_greedy(hf, p, 6)) for p in prompts]
    got: list = [None] * len(prompts)

    def one(i: int) -> None:
        got[i] = complete(servers["d"], prompts[i], max_tokens=6)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.json()["choices"][0]["text"] for r in got] == want
    assert [r.json()["usage"]["pd"]["pages_received"] for r in got] == [
        -(-len(p) // PAGE) for p in prompts
    ]
    one_token = complete(servers["d"], prompts[0] + [1], max_tokens=1)  # ends at the hand-off
    assert one_token.json()["choices"][0]["text"] == ByteCodec(97).decode(
        hf_greedy(hf, prompts[0] + [1], 1)
    )
    for srv in servers.values():
        assert srv.wait_idle()["ok"]


def test_streaming_through_decode_equals_whole(servers: dict[str, Server]) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{servers['d'].url}/v1", api_key="none", max_retries=0)
    prompt = PROMPTS[1] + [3, 4, 5]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    usage = chunks[-1].usage.model_dump()
    assert usage["pd"]["pages_received"] == 1 and usage["pd"]["pages_skipped"] == 3

"""P/D with latent (MLA) pages: a prefill worker sends a DeepseekV3 model's latent rows (the
latent after kv_a_layernorm and the rotated RoPE key, as transformers caches them), and a
decode worker's greedy tokens equal transformers' from scratch, cold and on a decode hit (only
the missing pages cross)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.pd.wire import read_pages
from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import PAGE, complete, info, raw_handoff, start_all, worker_args
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf, rel_err

PROMPT = [(5 * i + 1) % 97 for i in range(41)]
MLA_CKPT = {"seed": 6, "max_position_embeddings": 512}
"""This module's tiny DeepseekV3: 3 layers, latent rows of 16 + 8 values (the `mla_ckpt`
fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, mla_ckpt: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("pd-mla")
    (p,) = start_all([(worker_args(mla_ckpt, "--role", "prefill"), tmp / "p.log")])
    (d,) = start_all(
        [(worker_args(mla_ckpt, "--role", "decode", "--pd-prefill", p.url), tmp / "d.log")]
    )
    yield {"p": p, "d": d}
    for x in (p, d):
        x.stop()


@pytest.mark.slow
@torch.no_grad()
def test_latent_pages_sent_equal_transformers_cache_and_decode_hits(
    servers: dict[str, Server], mla_ckpt: Path
) -> None:
    hf = load_hf(mla_ckpt)
    pinfo = info(servers["p"])
    lay = pinfo["layout"]
    assert (lay["layers"], lay["kv_heads"], lay["head_dim"]) == (3, 1, 12)  # [latent | k_pe] / 2
    head, frames = raw_handoff(pinfo["transfer_endpoint"], PROMPT, [], lay, hid="mla0")
    got = read_pages(head, frames, lay["page_bytes"])
    ref = hf(torch.tensor([PROMPT]), use_cache=True)
    assert rel_err(torch.from_numpy(got.logits), ref.logits[0, -1].float()) <= 1e-4
    n = len(PROMPT)
    rows = torch.from_numpy(np.concatenate([np.frombuffer(p, np.float32) for p in got.pages]))
    rows = rows.view(len(got.pages), 3, 2, PAGE, 12)  # [page, layer, half, token, D/2]
    rows = rows.permute(1, 0, 3, 2, 4).reshape(3, -1, 24)[:, :n]  # [layer, token, D]
    for layer in range(3):
        cached = ref.past_key_values.layers[layer]  # transformers caches latent and k_pe
        latent, k_pe = cached.keys[0, 0], cached.values[0, 0]  # [tokens, 16], [tokens, 8]
        assert rel_err(rows[layer, :, :16], latent) <= 1e-4
        assert rel_err(rows[layer, :, 16:], k_pe) <= 1e-4
    want = ByteCodec(97).decode(hf_greedy(hf, PROMPT, 8))
    for _ in range(2):  # cold, then a decode hit (only the last page crosses)
        r = complete(servers["d"], PROMPT, max_tokens=8)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    assert r.json()["usage"]["pd"]["pages_skipped"] == (n - 1) // PAGE
    for srv in servers.values():
        assert srv.wait_idle()["ok"]

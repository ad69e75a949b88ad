"""P/D with a DeepSeek-V3 checkpoint's own NextN layer as the draft: router, prefill and decode
workers as real processes on 127.0.0.1 (`--spec-draft nextn`).

- greedy text through the router equals one server's without speculation, and each request's
  acceptance sequence equals one server's speculative run (cold prompts, then turns whose
  earlier pages decode already holds);
- every latent page prefill sends carries the NextN layer's latent and the target-state layers,
  and those bytes, with the hidden state that crosses beside them, equal a cold single-server
  prefill's bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch

from kvstrata.pd.wire import read_pages
from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import PAGE, info, raw_handoff, start_all, worker_args
from tests.serve_helpers import Server, free_port
from tests.test_pd_spec import (
    FRESH,
    NEW,
    PROMPTS,
    SPEC_TOKENS,
    cold_prefill,
    expected_spec,
    single_server,
)

torch.set_num_threads(1)
LAYERS = 3
MLA_CKPT = {"seed": 3, "num_nextn_predict_layers": 1}
"""tests/test_nextn_mla.py's tiny DeepseekV3 with a NextN layer (built once per session)."""


@pytest.fixture(scope="module")
def pd(mla_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("pd-nextn")
    spec = [
        "--spec-draft",
        "nextn",
        "--spec-tokens",
        str(SPEC_TOKENS),
        "--model-cache-dir",
        str(tmp),
    ]
    refs = {
        "spec": single_server(mla_ckpt, tmp, "nextn"),
        "plain": single_server(mla_ckpt, tmp, ""),
    }
    port = free_port()
    p, d = start_all(
        [
            (worker_args(mla_ckpt, "--role", "prefill", *spec), tmp / "p.log", port),
            (worker_args(mla_ckpt, "--role", "decode", "--pd-prefill",
                         f"http://127.0.0.1:{port}", *spec), tmp / "d.log"),
        ]
    )  # fmt: skip
    r = Server(["--role", "router", "--prefill", p.url, "--decode", d.url], tmp / "r.log")
    yield {"p": p, "d": d, "r": r, "tmp": tmp, **refs}
    for x in (r, d, p):
        x.stop()


@pytest.mark.slow
def test_router_tokens_and_acceptance_equal_single_server(pd: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{pd['r'].url}/v1", api_key="none", max_retries=0)
    for i, (prompt, ref, plain) in enumerate(zip(PROMPTS, pd["spec"], pd["plain"], strict=True)):
        assert ref.output == plain.output
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
        assert out.choices[0].text == ByteCodec(97).decode(plain.output)
        usage = out.usage.model_extra
        assert usage["spec"] == expected_spec(ref), f"turn {i}"
        held = len(PROMPTS[i - 1]) // PAGE if i else 0
        assert usage["pd"]["pages_skipped"] == held
        for worker in (pd["p"], pd["d"]):
            assert worker.wait_idle()["ok"]
    assert sum(sum(r.spec_accepts) for r in pd["spec"]) > 0


@pytest.mark.slow
def test_sent_latent_pages_carry_the_nextn_state_bit_for_bit(
    pd: dict[str, Any], mla_ckpt: Path
) -> None:
    pinfo = info(pd["p"])
    lay = pinfo["layout"]
    pages, state = cold_prefill(mla_ckpt, pd["tmp"], "nextn", FRESH)
    assert lay["layers"] == pages.shape[1] > LAYERS + 1 and lay["draft"]
    head, frames = raw_handoff(pinfo["transfer_endpoint"], FRESH, [], lay, hid="nextn")
    assert head["type"] == "pages", head
    got = read_pages(head, frames, lay["page_bytes"], want_state=True)
    assert len(got.pages) == pages.shape[0] == 6
    for i, raw in enumerate(got.pages):
        page = torch.from_numpy(np.frombuffer(raw, np.float32).copy()).view(pages.shape[1:])
        assert torch.equal(page, pages[i]), f"page {i}"
        assert bool(page[LAYERS].abs().sum() > 0)  # the NextN latent
        full = (i + 1) * PAGE <= len(FRESH)  # a full page holds h at its last position
        assert bool(page[LAYERS + 1 :].abs().sum() > 0) == full
    assert got.state is not None and torch.equal(torch.from_numpy(got.state), state)

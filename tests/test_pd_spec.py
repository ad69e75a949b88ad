"""P/D with speculative decoding: router + prefill + decode workers as real
processes on 127.0.0.1, speculating with a draft model (self:2) and with an MTP head.

- greedy text through the router equals the single-server run without speculation;
- each request's acceptance sequence (usage.spec.accepts) equals the single-server speculative
  run's exactly, on cold prompts and on turns whose prefix decode already holds;
- every page prefill sends carries its draft tail layers, and those bytes (and the MTP head's
  hidden state that crosses with them) equal a cold single-server prefill's bit for bit;
- a decode worker whose draft differs is refused at the handshake, naming the field `draft`;
- a reply whose pages lack their draft part, or lacks the MTP head's state, is refused whole.

The MTP head starts from `mtp:random`'s fixed random weights; its input projection and output
norm are then set so it echoes the target's prediction at the previous position (a random head
accepts nothing on this model, which would make the acceptance checks vacuous). Its drafts then
depend on the target's hidden state, which only the prefill worker computes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import openai
import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request, State
from kvstrata.pd.wire import WireError, pages_message, read_header, read_pages
from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import PAGE, info, raw_handoff, start_all, worker_args
from tests.serve_helpers import Server, free_port
from tests.tiny_models import save_echo_head

torch.set_num_threads(1)
TARGET_LAYERS = 3
SPEC_TOKENS = 3
NEW = 12
POOLS = dict(page_size=PAGE, device_pages=40, host_pages=64)  # as worker_args' pools
FRESH = [(11 * i + 5) % 97 for i in range(45)]  # 6 pages, the last one partial


def conversation(turns: int = 3, seed: int = 0) -> list[list[int]]:
    """Each turn's prompt extends the previous one: decode holds the earlier pages."""
    rng, hist, out = random.Random(seed), [], []
    for _ in range(turns):
        hist = hist + [rng.randrange(5, 97) for _ in range(rng.randrange(20, 40))]
        out.append(list(hist))
    return out


PROMPTS = conversation()


CKPT = {"seed": 5, "num_hidden_layers": TARGET_LAYERS, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def drafts(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """--spec-draft of each kind: self:2, and the echoing MTP head (a safetensors file)."""
    path = tmp_path_factory.mktemp("mtp") / "echo.safetensors"
    return {"self": "self:2", "mtp": save_echo_head(ckpt, path)}


def engine_of(ckpt: Path, cache_dir: Path, draft: str, tiers: str = "device_host") -> Any:
    """An in-process engine built like a worker's (tests/pd_helpers.worker_args)."""
    cfg = EngineConfig(
        model=str(ckpt), chunk_tokens=64, max_batch_tokens=256, threads=1,
        spec_draft=draft, spec_tokens=SPEC_TOKENS, model_cache_dir=str(cache_dir),
    )  # fmt: skip
    return build_engine(cfg, CacheConfig(**POOLS).with_tiers(tiers))


def single_server(ckpt: Path, cache_dir: Path, draft: str) -> list[Request]:
    """PROMPTS one after another on one engine (later turns hit its cache), integrity each step."""
    built = engine_of(ckpt, cache_dir, draft)
    reqs = [Request(f"s{i}", p, NEW) for i, p in enumerate(PROMPTS)]
    for req in reqs:
        built.engine.submit(req)
        while built.engine.has_work():
            built.engine.step()
            built.engine.check_integrity()
    built.close()
    return reqs


def cold_prefill(ckpt: Path, cache_dir: Path, draft: str, prompt: list[int]) -> tuple:
    """A cold single-server prefill of `prompt`: its pages in the wire's host layout
    [n, layers, 2, page, heads, dim] and the speculator's hand-off state (None: a draft model)."""
    built = engine_of(ckpt, cache_dir, draft, tiers="none")
    eng, req = built.engine, Request("cold", prompt, 2)
    eng.submit(req)
    while req.state is not State.DECODE:  # the prompt and its first token: the pages are final
        eng.step()
    n = -(-len(prompt) // PAGE)
    pages = eng.pool.data[:, :, req.page_table[:n]].permute(2, 0, 1, 3, 4, 5).clone()
    state = eng.spec.handoff_state(req)
    built.close()
    return pages, None if state is None else state.clone()


@pytest.fixture(scope="module", params=["self", "mtp"])
def pd(
    request: pytest.FixtureRequest,
    ckpt: Path,
    drafts: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """Prefill, decode and router processes speculating with one draft, and the references."""
    tmp = tmp_path_factory.mktemp(f"pd-{request.param}")
    draft = drafts[request.param]
    spec = ["--spec-draft", draft, "--spec-tokens", str(SPEC_TOKENS), "--model-cache-dir", str(tmp)]
    # in-process first: builds the self:K draft checkpoint once, before the workers read it
    refs = {"spec": single_server(ckpt, tmp, draft), "plain": single_server(ckpt, tmp, "")}
    port = free_port()  # prefill's: decode lists it
    p, d = start_all(
        [
            (worker_args(ckpt, "--role", "prefill", *spec), tmp / "p.log", port),
            (worker_args(ckpt, "--role", "decode", "--pd-prefill", f"http://127.0.0.1:{port}",
                         *spec), tmp / "d.log"),
        ]
    )  # fmt: skip
    r = Server(["--role", "router", "--prefill", p.url, "--decode", d.url], tmp / "r.log")
    yield {"p": p, "d": d, "r": r, "draft": draft, "kind": request.param, "tmp": tmp, **refs}
    for x in (r, d, p):
        x.stop()


def expected_spec(req: Request) -> dict[str, Any]:
    steps = len(req.spec_accepts)
    return {
        "verify_steps": steps,
        "proposed": req.spec_proposed,
        "accepted": sum(req.spec_accepts),
        "acceptance_rate": req.acceptance_rate,
        "mean_accepted_length": req.accept_length,
        "accepts": req.spec_accepts,
    }


@pytest.mark.slow
def test_tokens_and_acceptance_through_router_equal_single_server(pd: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{pd['r'].url}/v1", api_key="none", max_retries=0)
    for i, (prompt, ref, plain) in enumerate(zip(PROMPTS, pd["spec"], pd["plain"], strict=True)):
        assert ref.output == plain.output  # speculation leaves greedy tokens as they are
        kw = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0}
        if i == 1:  # streamed through the router: the last chunk's usage has spec and pd
            chunks = list(
                client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            usage = chunks[-1].usage.model_extra
        else:
            out = client.completions.create(**kw)
            text, usage = out.choices[0].text, out.usage.model_extra
        assert text == ByteCodec(97).decode(plain.output)
        assert usage["spec"] == expected_spec(ref), f"turn {i}"
        held = len(PROMPTS[i - 1]) // PAGE if i else 0  # turn i-1's full prompt pages
        assert usage["pd"]["pages_skipped"] == held
        assert usage["pd"]["pages_received"] == -(-len(prompt) // PAGE) - held
        layout = info(pd["p"])["layout"]
        assert usage["pd"]["bytes_received"] == usage["pd"]["pages_received"] * layout["page_bytes"]
        for worker in (pd["p"], pd["d"]):
            assert worker.wait_idle()["ok"]  # pools and tree intact after each hand-off
    assert sum(sum(r.spec_accepts) for r in pd["spec"]) > 0  # the checks compare real drafts
    metrics = httpx.get(f"{pd['d'].url}/metrics", timeout=30).text
    accepted = sum(sum(r.spec_accepts) for r in pd["spec"])
    assert (
        f'kvstrata:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {accepted:.1f}'
        in (metrics)
    )


@pytest.mark.slow
def test_transferred_pages_carry_the_draft_part_bit_for_bit(pd: dict[str, Any], ckpt: Path) -> None:
    pinfo = info(pd["p"])
    lay = pinfo["layout"]
    pages, state = cold_prefill(ckpt, pd["tmp"], pd["draft"], FRESH)
    assert lay["layers"] == pages.shape[1] > TARGET_LAYERS and lay["draft"]
    assert lay["page_bytes"] == pages[0].numel() * pages.element_size()
    head, frames = raw_handoff(pinfo["transfer_endpoint"], FRESH, [], lay, hid="bytes")
    assert head["type"] == "pages", head
    got = read_pages(head, frames, lay["page_bytes"], want_state=pd["kind"] == "mtp")
    assert len(got.pages) == pages.shape[0] == 6
    for i, raw in enumerate(got.pages):
        page = torch.from_numpy(np.frombuffer(raw, np.float32).copy()).view(pages.shape[1:])
        assert torch.equal(page[TARGET_LAYERS:], pages[i, TARGET_LAYERS:]), f"page {i}: draft"
        assert torch.equal(page[:TARGET_LAYERS], pages[i, :TARGET_LAYERS]), f"page {i}: target"
        assert bool(page[TARGET_LAYERS:].abs().sum() > 0)  # the draft's layers were written
    if pd["kind"] == "mtp":  # h at the last prompt token crosses with the pages, exactly
        assert got.state is not None and torch.equal(torch.from_numpy(got.state), state)
    else:
        assert got.state is None and state is None
    assert pd["p"].wait_idle()["ok"]


@pytest.mark.slow
def test_draft_mismatch_refused_naming_the_field(
    pd: dict[str, Any], ckpt: Path, drafts: dict[str, str]
) -> None:
    pinfo = info(pd["p"])
    lay = {**pinfo["layout"], "draft": "draft:0123"}
    head, _ = raw_handoff(pinfo["transfer_endpoint"], FRESH, [], lay, hid="other")
    assert head["type"] == "refused"
    assert head["message"].startswith("layout mismatch: draft is "), head["message"]
    other = drafts["mtp" if pd["kind"] == "self" else "self"]  # a real decode with the other kind
    spec = ["--spec-draft", other, "--model-cache-dir", str(pd["tmp"])]
    spec += ["--pd-prefill", pd["p"].url]
    (d,) = start_all([(worker_args(ckpt, "--role", "decode", *spec), pd["tmp"] / "d2.log")])
    try:
        body = {"prompt": FRESH, "max_tokens": 4, "temperature": 0, "pd_prefill": pd["p"].url}
        r = httpx.post(f"{d.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 502, r.text
        msg = r.json()["error"]["message"]
        assert "layout mismatch: draft is " in msg and pinfo["transfer_endpoint"] in msg, msg
        assert d.wait_idle()["ok"] and pd["p"].wait_idle()["ok"]
    finally:
        d.stop()


def test_a_page_without_its_draft_part_or_state_is_refused_whole() -> None:
    """Wire level: pages of the target's size only (checksums valid) are refused, all of them;
    so is an MTP reply without the hidden state, or with a state that fails its checksum."""
    full, target = 5 * 1024, 3 * 1024  # page bytes with and without the draft's tail layers
    rng = np.random.default_rng(0)
    row, state = rng.random(97, dtype=np.float32), rng.random((1, 64), dtype=np.float32)
    whole = [rng.integers(0, 255, full, dtype=np.uint8) for _ in range(3)]
    ok = pages_message("h", 0, whole, row, state, computed_tokens=20)
    got = read_pages(read_header(ok), ok, full, want_state=True)
    assert len(got.pages) == 3 and np.array_equal(got.state, state)
    cut = pages_message("h", 0, [p[:target] for p in whole], row, state)
    with pytest.raises(WireError, match="page 0: 3072 bytes, expected 5120"):
        read_pages(read_header(cut), cut, full, want_state=True)
    stateless = pages_message("h", 0, whole, row)
    with pytest.raises(WireError, match="hidden state"):
        read_pages(read_header(stateless), stateless, full, want_state=True)
    assert read_pages(read_header(stateless), stateless, full).state is None  # a draft model
    bad = [*ok[:-1], ok[-1].copy()]
    bad[-1][0, 3] += 1.0
    with pytest.raises(WireError, match="state failed its checksum"):
        read_pages(read_header(bad), bad, full, want_state=True)

"""`kvstrata serve --spec-draft self:K` through the openai client: each request's usage.spec and
the /metrics spec_decode_* counters equal what the engine counted in-process for the same
requests, greedy tokens equal plain decoding, and a prefix hit leaves acceptance unchanged; the
same with --tp 2 (two gloo ranks behind the server); an MTP head with --tp 2 is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.serve.codec import ByteCodec
from tests.serve_helpers import TINY_ENGINE, Server, metrics_when

torch.set_num_threads(1)
SPEC = ["--spec-draft", "self:2", "--spec-tokens", "3"]
POOLS = ["--device-pages", "64", "--host-pages", "64"]
PROMPTS = [[(7 * i + 3 + k) % 97 for i in range(30 + 5 * k)] for k in range(3)]
NEW = 12


CKPT = {"seed": 5, "num_hidden_layers": 3, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve")
    args = ["--model", str(ckpt), *TINY_ENGINE, *POOLS, *SPEC, "--model-cache-dir", str(tmp)]
    srv = Server([*args, "--debug-endpoints"], tmp / "server.log")
    yield srv
    assert srv.terminate() == 0, (tmp / "server.log").read_text()


def in_process(ckpt: Path, tmp: Path, draft: str) -> list[Request]:
    """The same requests one after another on an engine built like the server's."""
    cfg = EngineConfig(
        model=str(ckpt), chunk_tokens=64, max_batch_tokens=256, threads=1,
        spec_draft=draft, spec_tokens=3, model_cache_dir=str(tmp),
    )  # fmt: skip
    built = build_engine(cfg, CacheConfig(page_size=8, device_pages=64, host_pages=64))
    reqs = [Request(f"r{i}", p, NEW) for i, p in enumerate([*PROMPTS, PROMPTS[0]])]
    for r in reqs:
        built.engine.run([r])
        built.engine.check_integrity()
    built.close()
    return reqs


def expected_spec(r: Request) -> dict:
    """usage.spec of a request the engine ran as `r`."""
    return {
        "verify_steps": len(r.spec_accepts),
        "proposed": r.spec_proposed,
        "accepted": sum(r.spec_accepts),
        "acceptance_rate": r.acceptance_rate,
        "mean_accepted_length": r.accept_length,
        "accepts": r.spec_accepts,
    }


def drafts_total(metrics: str) -> float | None:
    """kvstrata:spec_decode_num_drafts_total in /metrics text (None: not there yet)."""
    name = 'kvstrata:spec_decode_num_drafts_total{model_name="tiny"} '
    found = [float(x[len(name) :]) for x in metrics.splitlines() if x.startswith(name)]
    return found[0] if found else None


def check_metrics(srv: Server, ref: list[Request]) -> None:
    """/metrics spec_decode_* counters equal the in-process engine's counts over `ref`."""
    text = httpx.get(f"{srv.url}/metrics").text
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvstrata:spec_decode_")
    }
    lbl = '{model_name="tiny"}'
    assert values[f"kvstrata:spec_decode_num_drafts_total{lbl}"] == sum(
        len(r.spec_accepts) for r in ref
    )
    assert values[f"kvstrata:spec_decode_num_draft_tokens_total{lbl}"] == sum(
        r.spec_proposed for r in ref
    )
    accepted = sum(sum(r.spec_accepts) for r in ref)
    assert values[f"kvstrata:spec_decode_num_accepted_tokens_total{lbl}"] == accepted
    per_pos = [
        values[f'kvstrata:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{j}"}}']
        for j in range(3)
    ]  # fmt: skip
    assert per_pos == [sum(a > j for r in ref for a in r.spec_accepts) for j in range(3)]
    assert sum(per_pos) == accepted and per_pos[2] > 0  # every position counted at least once


def test_usage_and_metrics_count_speculation(server: Server, ckpt: Path, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    ref = in_process(ckpt, tmp_path, "self:2")
    plain = in_process(ckpt, tmp_path, "")
    got = []
    for i, p in enumerate([*PROMPTS, PROMPTS[0]]):  # the last one: its prefix is a device hit
        kw = {"model": "tiny", "prompt": p, "max_tokens": NEW, "temperature": 0}
        if i == 1:  # streamed: the final usage chunk carries spec too
            chunks = list(
                client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
            )
            got.append(chunks[-1].usage.model_extra["spec"])
        else:
            got.append(client.completions.create(**kw).usage.model_extra["spec"])
    assert all(r.output == q.output for r, q in zip(ref, plain, strict=True))
    for spec, r in zip(got, ref, strict=True):
        assert spec == expected_spec(r)
        assert spec["proposed"] > 0 and spec["mean_accepted_length"] >= 1.0
    assert got[-1] == got[0]  # the prefix hit (draft KV restored with the page): same acceptance
    server.wait_idle()
    check_metrics(server, ref)


def test_tp2_server_speculates_like_one_rank(ckpt: Path, tmp_path: Path) -> None:
    """`serve --tp 2 --spec-draft self:2`: the text, usage.spec and /metrics of one rank."""
    args = ["--model", str(ckpt), *TINY_ENGINE, *POOLS, *SPEC, "--model-cache-dir", str(tmp_path)]
    srv = Server([*args, "--tp", "2", "--debug-endpoints"], tmp_path / "two.log")
    try:
        ref = in_process(ckpt, tmp_path, "self:2")
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        for p, r in zip([*PROMPTS, PROMPTS[0]], ref, strict=True):
            out = client.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0)
            assert out.choices[0].text == ByteCodec(97).decode(r.output)
            assert out.usage.model_extra["spec"] == expected_spec(r)
        assert sum(map(sum, (r.spec_accepts for r in ref))) > 0
        srv.wait_idle()
        want = sum(len(r.spec_accepts) for r in ref)
        # rank 0 reports its counters every 0.5 s
        metrics_when(srv.url, lambda t: drafts_total(t) == want, f"{want} drafts")
        check_metrics(srv, ref)
    finally:
        assert srv.terminate(timeout_s=120) == 0, (tmp_path / "two.log").read_text()


def test_mtp_refused_with_tp(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="--tp > 1"):
        Server(["--model", str(ckpt), *TINY_ENGINE, "--spec-draft", "mtp:random", "--tp", "2"],
               tmp_path / "log")  # fmt: skip

"""`kvstrata run --model DIR` and `kvstrata serve --model DIR` on a tiny random DeepseekV3 (MLA +
MoE) checkpoint: latent pages through every tier set, exact cached-token counts when serving."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from kvstrata.cli.main import main
from kvstrata.cli.run_cmd import QUICK
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.serve.codec import HFCodec
from kvstrata.workloads.agent import build_workload
from tests.conftest import TinyCheckpoints
from tests.serve_helpers import TINY_ENGINE, Server
from tests.tiny_models import save_plain_tokenizer

torch.set_num_threads(1)
MLA_CKPT = {"seed": 4, "max_position_embeddings": 512}
"""This module's tiny DeepseekV3 (the `mla_ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def server(mla_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-mla") / "server.log"
    args = ["--model", str(mla_ckpt), *TINY_ENGINE, "--device-pages", "64", "--host-pages", "64"]
    srv = Server([*args, "--debug-endpoints"], log)
    yield srv
    assert srv.terminate() == 0, log.read_text()


def test_serve_an_mla_checkpoint_with_exact_cached_tokens(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    p = [(5 * i + 2) % 97 for i in range(41)]  # 5 full pages of 8 (+1 token)
    first = client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0)
    again = client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 40  # latent pages from device memory
    assert again.choices[0].text == first.choices[0].text  # greedy: cached = computed
    rep = server.wait_idle()
    assert rep["ok"] is True, rep


@pytest.mark.slow
def test_run_an_mla_checkpoint_through_every_tier(mla_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["run", "--quick", "--no-pd", "--model", str(mla_ckpt), "--out", str(out)]
    tiny = ["--page-size", "8", "--chunk-tokens", "64", "--max-batch-tokens", "128"]
    assert main([*args, *tiny, "--sessions", "1", "--turns", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert (
        report["outputs_identical"] is True
    )  # none, device, device_host, device_host_storage agree
    second = report["configs"]["device"]["requests"][1]
    assert second["hits"]["device"] > 0  # turn 2 reuses turn 1's latent pages
    assert any((out / "store").iterdir())  # latent units written by the device_host_storage run


@pytest.mark.slow
def test_run_a_base_checkpoint_whose_tokenizer_has_no_chat_template(
    tiny_checkpoints: TinyCheckpoints, tmp_path: Path
) -> None:
    # Character-level prompts are long: the quick workload's text needs ~1.5k positions.
    src = tiny_checkpoints.deepseek(seed=4, max_position_embeddings=2048)
    model = tmp_path / "tiny"
    shutil.copytree(src, model)
    tok = Tokenizer(save_plain_tokenizer(model))
    assert not tok.has_chat_template
    out = tmp_path / "out"
    args = ["run", "--quick", "--no-pd", "--model", str(model), "--out", str(out)]
    tiny = ["--page-size", "16", "--chunk-tokens", "256", "--sessions", "1", "--turns", "2"]
    assert main([*args, *tiny]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["outputs_identical"] is True
    prompts = build_workload(dataclasses.replace(QUICK, sessions=1, turns=2), 97, tok.encode_chat)
    ran = [r["prompt_tokens"] for r in report["configs"]["device"]["requests"]]
    assert ran == [len(p) for p in prompts[0]]  # the workload's plain text turns, as rendered
    text = tok.decode(prompts[0][1])
    assert text.startswith("system: ") and "\nuser: " in text and text.endswith("\nassistant: ")
    msgs = [{"role": "user", "content": "hi"}]
    assert HFCodec(model).encode_chat(msgs) == tok.encode("user: hi\nassistant: ")  # serve's chat

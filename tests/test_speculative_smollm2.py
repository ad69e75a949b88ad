"""Speculative decoding on the real SmolLM2-135M with `self:K`: the same greedy tokens as plain
decoding on a chat prompt, drafts really accepted, and the draft built once as its own checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.model.smollm2 import ensure_smollm2
from kvstrata.model.tokenizer import Tokenizer

torch.set_num_threads(1)
pytestmark = pytest.mark.slow
PROMPT = "Write a Python function that returns the squares of the numbers 1 to 10 as a list."


def test_smollm2_self_draft_greedy_equals_plain(tmp_path: Path) -> None:
    path = ensure_smollm2()
    model, tok = load_model(path), Tokenizer(path)
    prompt = tok.encode_chat(PROMPT)
    outputs = {}
    for draft in ("", "self:26"):
        cfg = EngineConfig(spec_draft=draft, spec_tokens=3, model_cache_dir=str(tmp_path))
        built = build_engine(
            cfg, CacheConfig(page_size=16, device_pages=32, host_pages=0), model=model
        )
        req = Request("r", prompt, max_new_tokens=24)
        built.engine.run([req])
        built.engine.check_integrity()
        built.close()
        outputs[draft] = req
    spec = outputs["self:26"]
    assert spec.output == outputs[""].output
    assert sum(spec.spec_accepts) > 0  # the truncated model predicts some of the target's tokens
    (draft_dir,) = (tmp_path / "drafts").iterdir()
    assert draft_dir.name == f"{model.fingerprint}-self26"

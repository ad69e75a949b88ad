"""The real SmolLM2-135M-Instruct: converted once from the packaged GGUF, then checked against
transformers on one short chat prompt. Slow-marked, but part of the normal suite: the first run
converts (~60 s) into the default cache dir, later runs reuse the conversion (~2 s)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvstrata.memory.pool import DevicePool
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import SeqBatch
from kvstrata.model.smollm2 import MODEL_NAME, ensure_smollm2, find_gguf
from kvstrata.model.tokenizer import Tokenizer
from tests.tiny_models import hf_logits, load_hf, rel_err

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return ensure_smollm2()


def test_gguf_is_found_without_importing_its_package() -> None:
    path = find_gguf()
    assert path.name.endswith(".gguf") and path.stat().st_size > 50_000_000


def test_conversion_is_reused(smollm2_dir: Path) -> None:
    assert smollm2_dir.name == MODEL_NAME
    assert (smollm2_dir / "config.json").is_file() and (smollm2_dir / "tokenizer.json").is_file()
    assert "quantization_config" not in (smollm2_dir / "config.json").read_text()
    start = time.monotonic()
    assert ensure_smollm2() == smollm2_dir
    assert time.monotonic() - start < 1.0  # found, not converted again


def test_smollm2_matches_transformers(smollm2_dir: Path) -> None:
    model, tok = load_model(smollm2_dir), Tokenizer(smollm2_dir)
    assert model.spec.architecture == "LlamaForCausalLM" and model.spec.tie_word_embeddings
    prompt = tok.encode_chat("What is the capital of France?")
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    pool = DevicePool(model.kv_shape(16), 8)
    table = torch.tensor([5, 2, 7, 0])  # 64 tokens of context, pages out of order
    logits = model(SeqBatch.build([prompt], [0], [table]), pool)
    hf = load_hf(smollm2_dir)
    ref = hf_logits(hf, prompt)
    assert rel_err(logits, ref) <= 1e-4
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))

    generated = [int(logits[-1].argmax())]
    while len(generated) < 8 and generated[-1] not in tok.eos_token_ids:
        step = SeqBatch.build([generated[-1:]], [len(prompt) + len(generated) - 1], [table])
        generated.append(int(model(step, pool, last_only=True)[0].argmax()))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert generated == out[0, len(prompt) :].tolist()
    assert "Paris" in tok.decode(generated)

"""Checkpoint loading, config parsing, fingerprints and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool
from kvstrata.model.checkpoint import fingerprint, load_model, parse_spec, read_config
from kvstrata.model.decoder import SeqBatch
from tests.tiny_models import hf_logits, load_hf, make_llama, make_qwen2, rel_err

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama"), seed=0)


def edit_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_path_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a Hugging Face checkpoint: missing config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="missing config.json"):
        load_model(tmp_path / "does-not-exist")


def test_config_without_weights_is_rejected(llama: Path, tmp_path: Path) -> None:
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        load_model(tmp_path)


def test_unknown_architecture_is_rejected(llama: Path, tmp_path: Path) -> None:
    bad = edit_config(llama, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel"):
        load_model(bad)


def test_unsupported_rope_type_is_rejected(llama: Path, tmp_path: Path) -> None:
    params = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5000.0}
    bad = edit_config(llama, tmp_path / "dyn", rope_parameters=params)
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        load_model(bad)


def test_bad_dtype_is_rejected(llama: Path) -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(llama, dtype="float64")


def test_old_style_rope_config_is_understood() -> None:
    cfg = {
        **{"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8},
        **{"intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2},
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    }
    spec = parse_spec(cfg)
    assert spec.rope_theta == 500000.0 and spec.num_kv_heads == 2 and spec.head_dim == 4
    assert spec.rope_scaling == {"factor": 4.0, "rope_type": "linear"}


def test_weights_that_do_not_fit_the_config_are_rejected(llama: Path, tmp_path: Path) -> None:
    bad = edit_config(llama, tmp_path / "more-layers", num_hidden_layers=3)
    with pytest.raises(
        ValueError, match=r"does not match LlamaForCausalLM: missing \['model.layers.2"
    ):
        load_model(bad)


def test_fingerprint_identifies_the_weights(llama: Path, tmp_path: Path) -> None:
    same = make_llama(tmp_path / "same", seed=0)
    other = make_llama(tmp_path / "other", seed=1)
    fp = load_model(llama).fingerprint
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert fingerprint(same) == fp  # same seed, another directory
    assert fingerprint(other) != fp
    assert fingerprint(make_qwen2(tmp_path / "q", seed=0)) != fp
    code = f"from kvstrata.model.checkpoint import fingerprint; print(fingerprint({str(llama)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == fp  # another process (its own hash seed) agrees


def test_sharded_checkpoint_loads_like_one_file(llama: Path, tmp_path: Path) -> None:
    hf = load_hf(llama)
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_model(tmp_path)
    toks = [3, 14, 15, 92, 65, 35, 89]
    pool = DevicePool(model.kv_shape(4), 4)
    logits = model(SeqBatch.build([toks], [0], [torch.arange(2)]), pool)
    assert rel_err(logits, hf_logits(hf, toks)) <= 1e-4
    assert model.fingerprint != "" and model.fingerprint == fingerprint(tmp_path)


def test_kv_shape_and_dtypes(llama: Path) -> None:
    model = load_model(llama, dtype="bfloat16")
    assert model.kv_shape(16) == KVShape(2, 2, 16, 16, "bfloat16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    pool = DevicePool(model.kv_shape(4), 4)
    logits = model(SeqBatch.build([[1, 2, 3, 4, 5]], [0], [torch.arange(2)]), pool)
    ref = hf_logits(load_hf(llama), [1, 2, 3, 4, 5])
    assert logits.dtype == torch.float32 and rel_err(logits, ref) < 0.05  # bf16 rounding only
    assert read_config(llama)["model_type"] == "llama"


def test_bad_batches_are_rejected(llama: Path) -> None:
    model = load_model(llama)
    pool = DevicePool(model.kv_shape(4), 4)
    table = torch.arange(2)
    with pytest.raises(ValueError, match="too few pages"):
        model(SeqBatch.build([list(range(9))], [0], [table]), pool)
    with pytest.raises(ValueError, match=r"page ids outside \[0, 4\)"):
        model(SeqBatch.build([[1, 2]], [0], [torch.tensor([4])]), pool)
    with pytest.raises(ValueError, match="positions must lie in"):
        batch = SeqBatch.build([[1, 2]], [0], [table])
        model(SeqBatch(batch.input_ids, torch.tensor([0, 2]), [2], [2], [table]), pool)
    with pytest.raises(ValueError, match="seq_lens must be >= 1 each and sum to T=2"):
        model(SeqBatch(torch.tensor([1, 2]), torch.tensor([0, 1]), [1], [2], [table]), pool)
    sharded = DevicePool(model.kv_shape(4), 4, n_shards=2, rank=0)
    with pytest.raises(ValueError, match="context-parallel"):
        model(SeqBatch.build([[1, 2]], [0], [table]), sharded)

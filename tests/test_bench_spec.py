"""`kvstrata bench spec`'s measurement on a tiny model: every key, the restores really hit their
tier, and acceptance after each restore equals cold exactly; `--model DIR` benches a DeepSeek-V3
checkpoint's own NextN layer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvstrata.bench import spec as bench_spec
from kvstrata.bench.registry import load_benches
from kvstrata.cli.main import main
from kvstrata.model.checkpoint import load_model
from kvstrata.model.nextn import NEXTN_FILE
from kvstrata.model.nextn_data import DataConfig
from kvstrata.model.nextn_train import TrainConfig, train_nextn
from kvstrata.workloads.agent import WorkloadSpec
from tests.tiny_models import make_llama

torch.set_num_threads(1)
# tiny llama: hidden 64, 2 x 32-wide K/V (2 heads x 16), MLP 112, vocab 97 (tests/tiny_models.py)
LAYER = 2 * 64 * (64 + 32) + 3 * 64 * 112
HEAD = 97 * 64
MLA_CKPT = {"seed": 3, "num_nextn_predict_layers": 1}
"""A tiny DeepSeek-V3 with its own NextN layer (the `mla_ckpt` fixture of tests/conftest.py)."""


def _rounds() -> list[list[list[int]]]:
    rng = random.Random(0)
    rounds, hist = [], [[], []]
    for _ in range(3):
        hist = [h + [rng.randrange(5, 97) for _ in range(20)] for h in hist]
        rounds.append([list(h) for h in hist])
    return rounds


@pytest.mark.slow
def test_bench_spec_with_a_nextn_layer(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The bench's own draft kind: a NextN layer (trained here, tiny) beside the checkpoint;
    its draft state restored from device, host and storage gives the cold run's acceptance
    exactly."""
    monkeypatch.setattr(bench_spec, "PAGE", 8)
    ckpt = make_llama(tmp_path / "m", seed=2, num_hidden_layers=3)
    model = load_model(ckpt)
    rounds = _rounds()
    data = DataConfig(new_tokens=12, batch=4)
    cfg = TrainConfig(data=data, vocab=48, window=16, batch=4, steps=20, lr=3e-3)
    train_nextn(model, [r[0][:30] for r in rounds], ckpt / NEXTN_FILE, cfg)
    rep = bench_spec.measure(
        model, rounds, 10, tmp_path, draft="nextn", cache_dir=str(tmp_path), model_dir=str(ckpt)
    )
    assert rep["outputs_identical"] and rep["acceptance_sequences_identical"]
    assert rep["acceptance_equal_after_restores"] and rep["acceptance_cold"] > 0
    assert rep["storage_hit_pages"] == 2 * ((40 - 1) // 8 + (60 - 1) // 8)


def test_bench_spec_on_a_tiny_model(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    assert "spec" in load_benches().names()
    monkeypatch.setattr(bench_spec, "PAGE", 8)  # tiny prompts: several pages each
    model = load_model(make_llama(tmp_path / "m", seed=2, num_hidden_layers=3))
    rounds = _rounds()
    rep = bench_spec.measure(model, rounds, 10, tmp_path, draft="self:1", cache_dir=str(tmp_path))
    for key in (
        "acceptance_cold",
        "acceptance_device",
        "acceptance_host",
        "acceptance_storage",
        "tokens_per_s_spec",
        "tokens_per_s_plain",
        "outputs_identical",
    ):
        assert key in rep
    assert rep["outputs_identical"] and rep["acceptance_sequences_identical"]
    assert rep["acceptance_equal_after_restores"] and 0 < rep["acceptance_cold"] < 1
    assert rep["draft_cost_ratio"] == (1 * LAYER + HEAD) / (3 * LAYER + HEAD)
    # rounds 1 and 2, 2 sessions: the previous round's prompt pages (20 // 8, 40 // 8) from device
    # memory or host; from storage (stored by the device run, which ran every round) all but the
    # last token's page
    assert rep["device_hit_pages"] == rep["host_hit_pages"] == 2 * (2 + 5)
    assert rep["storage_hit_pages"] == 2 * ((40 - 1) // 8 + (60 - 1) // 8)
    # timed runs: rounds 1 and 2 on a warm device cache, plain and speculative alike
    assert rep["cache_states_identical"] and rep["timed_requests"] == 4
    assert rep["timed_prompt_tokens"] == 2 * (40 + 60)
    assert rep["timed_prefilled_tokens"] == 2 * (40 + 60) - 8 * 2 * (2 + 5)
    assert rep["timed_new_tokens"] == 4 * 10 and rep["timing_pairs"] == bench_spec.TIMING_PAIRS
    # the step breakdown: plain runs spend nothing in a draft; a verify step emits up to N + 1
    # tokens, so speculation never takes more steps than plain decoding
    assert rep["draft_ms_per_step_plain"] == 0 and rep["draft_ms_per_step_spec"] > 0
    assert 0 < rep["steps_spec"] <= rep["steps_plain"]
    assert rep["draft_ms_per_step_spec"] < rep["step_ms_spec"]
    assert rep["decode_step_ms_plain"] > 0 and rep["decode_step_ms_spec"] > 0


@pytest.mark.slow
def test_bench_spec_model_dir_with_its_own_nextn_layer(
    mla_ckpt: Path,
    tmp_path: Path,
    monkeypatch,  # noqa: ANN001
) -> None:
    """`kvstrata bench spec --quick --model DIR` on a DeepSeek-V3 checkpoint (no tokenizer: the
    workload as token ids): its NextN layer drafts, outputs equal plain decoding, acceptance
    after every restore equals cold, and the report names the checkpoint."""
    monkeypatch.setattr(bench_spec, "PAGE", 8)
    small = WorkloadSpec(sessions=2, turns=3, first_lines=2, tool_lines=1, max_new_tokens=10)
    monkeypatch.setattr(bench_spec, "QUICK", small)  # 50, 80, 110 prompt ids: fit 256 positions
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--quick", "--model", str(mla_ckpt), "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["model"] == str(mla_ckpt) and rep["architecture"] == "DeepseekV3ForCausalLM"
    assert rep["draft"] == "nextn" and rep["draft_cost_ratio"] is None
    assert rep["outputs_identical"] and rep["acceptance_sequences_identical"]
    assert rep["acceptance_equal_after_restores"] and rep["acceptance_cold"] > 0
    assert rep["device_hit_pages"] > 0 and rep["storage_hit_pages"] > 0

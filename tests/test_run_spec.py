"""`kvstrata run --spec-draft self:K`: acceptance per configuration in the table and report, the
same tokens as a run without speculation, the same acceptance after every tier's restores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstrata.cli.main import main
from tests.tiny_models import make_llama

torch.set_num_threads(1)
TINY = ["--page-size", "8", "--chunk-tokens", "64", "--max-batch-tokens", "128", "--no-pd"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(
        tmp_path_factory.mktemp("llama") / "ckpt",
        seed=1,
        num_hidden_layers=3,
        max_position_embeddings=512,
    )


def test_run_with_self_draft(ckpt: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    spec = ["--spec-draft", "self:1", "--spec-tokens", "3", "--model-cache-dir", str(tmp_path)]
    args = ["run", "--quick", "--model", str(ckpt), "--out", str(out), *TINY, *spec]
    assert main([*args, "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert "acc len" in printed and "identical" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["outputs_identical"] is True
    cfg = report["configs"]
    assert set(cfg) == {"none", "l1", "l1_l2", "l1_l2_l3", "plain"}
    assert cfg["plain"]["spec"] is None
    accepts = {}
    for name in ("none", "l1", "l1_l2", "l1_l2_l3"):
        fig = cfg[name]["spec"]
        assert fig["proposed"] > 0 and 0.0 <= fig["acceptance_rate"] <= 1.0
        assert fig["accept_length"] == (fig["accepted"] + fig["verify_steps"]) / fig["verify_steps"]
        accepts[name] = {r["rid"]: r["spec"]["accepts"] for r in cfg[name]["requests"]}
    # restores from every tier leave each request's acceptance sequence as on a cold cache
    assert all(a == accepts["none"] for a in accepts.values())
    assert cfg["l1_l2_l3"]["hit_rate"] > 0 and cfg["l1_l2"]["hit_rate_by_tier"]["L2"] > 0


def test_spec_draft_refused_with_ranks(ckpt: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    args = ["run", "--quick", "--model", str(ckpt), "--out", str(tmp_path / "o"), *TINY]
    args += ["--model-cache-dir", str(tmp_path)]
    assert main([*args, "--spec-draft", "self:1", "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--spec-draft" in err and len(err.splitlines()) == 1
    assert main([*args, "--spec-draft", "self:9"]) == 2
    assert "self:K" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "drafts").exists()

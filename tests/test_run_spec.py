"""`kvstrata run --spec-draft self:K`: acceptance per configuration in the table and report, the
same tokens as a run without speculation, the same acceptance after every tier's restores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstrata.cli.main import main

torch.set_num_threads(1)
TINY = ["--page-size", "8", "--chunk-tokens", "64", "--max-batch-tokens", "128", "--no-pd"]


CKPT = {"seed": 1, "num_hidden_layers": 3, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def run_report(ckpt: Path, tmp: Path, *extra: str) -> dict:
    """`kvstrata run --spec-draft self:1` (plus `extra`): its report.json."""
    out = tmp / "out"
    spec = ["--spec-draft", "self:1", "--spec-tokens", "3", "--model-cache-dir", str(tmp)]
    args = ["run", "--quick", "--model", str(ckpt), "--out", str(out), *TINY, *spec, *extra]
    assert main([*args, "--max-new-tokens", "12"]) == 0
    return json.loads((out / "report.json").read_text())


def accepts_of(report: dict) -> dict[str, dict[str, list[int]]]:
    """Each speculative configuration's per-request acceptance sequences."""
    cfg = report["configs"]
    names = ("none", "device", "device_host", "device_host_storage")
    return {n: {r["rid"]: r["spec"]["accepts"] for r in cfg[n]["requests"]} for n in names}


@pytest.fixture(scope="module")
def one_rank(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_report(ckpt, tmp_path_factory.mktemp("one"))


def test_run_with_self_draft(one_rank: dict, capsys) -> None:  # noqa: ANN001
    report = one_rank
    assert report["outputs_identical"] is True
    cfg = report["configs"]
    assert set(cfg) == {"none", "device", "device_host", "device_host_storage", "plain"}
    assert cfg["plain"]["spec"] is None
    for name in ("none", "device", "device_host", "device_host_storage"):
        fig = cfg[name]["spec"]
        assert fig["proposed"] > 0 and 0.0 <= fig["acceptance_rate"] <= 1.0
        assert fig["accept_length"] == (fig["accepted"] + fig["verify_steps"]) / fig["verify_steps"]
    accepts = accepts_of(report)
    # restores from every tier leave each request's acceptance sequence as on a cold cache
    assert all(a == accepts["none"] for a in accepts.values())
    assert (
        cfg["device_host_storage"]["hit_rate"] > 0
        and cfg["device_host"]["hit_rate_by_tier"]["host"] > 0
    )


def test_run_on_tp2_ranks_reports_the_same_acceptance(
    ckpt: Path,
    one_rank: dict,
    tmp_path: Path,
    capsys,  # noqa: ANN001
) -> None:
    report = run_report(ckpt, tmp_path, "--tp", "2")
    printed = capsys.readouterr().out
    assert "acc len" in printed and "identical" in printed
    assert report["outputs_identical"] is True
    assert accepts_of(report) == accepts_of(one_rank)  # every request, every configuration
    for name in ("none", "device", "device_host", "device_host_storage"):
        assert report["configs"][name]["spec"] == one_rank["configs"][name]["spec"]
    assert sum(sum(a) for a in accepts_of(report)["none"].values()) > 0


def test_spec_draft_refused_where_it_cannot_run(ckpt: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    args = ["run", "--quick", "--model", str(ckpt), "--out", str(tmp_path / "o"), *TINY]
    args += ["--model-cache-dir", str(tmp_path)]
    assert main([*args, "--spec-draft", "mtp:random", "--tp", "2"]) == 2  # before any rank
    err = capsys.readouterr().err.strip()
    assert "mtp:" in err and "--tp > 1" in err and len(err.splitlines()) == 1
    assert main([*args, "--spec-draft", "self:9"]) == 2
    assert "self:K" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "drafts").exists()

"""`kvstrata run --quick` on a tiny model (the pd row is on by default with one rank): the pd row (router + prefill + decode as real
processes) is in the table, the JSON report and the plot; its answers join the identical-outputs
check; the KV bytes prefill sent decode are exactly the pages decode did not hold x page bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli.main import main
from kvstrata.cli.run_cmd import QUICK
from kvstrata.model.checkpoint import load_model
from kvstrata.workloads.agent import build_workload
from tests.tiny_models import make_llama

pytestmark = pytest.mark.slow  # three real server processes besides the in-process rows

PAGE = 8


def test_run_quick_pd_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_llama(tmp_path / "tiny", seed=4, max_position_embeddings=1024)
    out = tmp_path / "out"
    args = ["run", "--quick", "--model", str(ckpt), "--out", str(out)]  # no --pd: the default
    assert main([*args, "--page-size", str(PAGE), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert (
        "P/D MB" in printed
        and "outputs identical across none, device, device_host, device_host_storage, pd" in printed
    )
    rep = json.loads((out / "report.json").read_text())
    assert rep["outputs_identical"] is True and (out / "ttft.png").stat().st_size > 0
    row = rep["configs"]["pd"]
    page_bytes = load_model(ckpt).kv_shape(PAGE).page_nbytes
    lens = [[len(p) for p in s] for s in build_workload(QUICK, 97)]
    want = sum(-(-s[0] // PAGE) for s in lens) + sum(
        -(-b // PAGE) - a // PAGE for s in lens for a, b in zip(s, s[1:], strict=False)
    )  # cold: every page; turn k: all but turn k-1's full pages, which decode holds
    assert row["pd_pages_sent"] == want
    assert row["pd_bytes_sent"] == want * page_bytes
    assert row["pd_pages_skipped"] == sum(a // PAGE for s in lens for a in s[:-1])
    assert len(row["requests"]) == sum(map(len, lens))
    ref = {r["rid"]: r["output"] for r in rep["configs"]["none"]["requests"]}
    for r in row["requests"]:  # the byte codec: one printable character per token id
        assert r["text"] == "".join(chr(32 + i % 95) for i in ref[r["rid"]])
    moved = row["bytes_moved"]  # both workers', from their /metrics
    shape = load_model(ckpt).kv_shape(PAGE)
    unit_bytes = page_bytes // (shape.num_layers * shape.num_kv_heads)  # 1 layer x 1 head
    assert moved["device->host"] % page_bytes == 0 and moved["device->host"] > 0
    # write-through: every page stored is backed up by the worker that stored it, but the
    # units the other worker wrote first to the shared store are kept, and move no bytes
    assert moved["host->storage"] % unit_bytes == 0
    assert 0 < moved["host->storage"] <= moved["device->host"]
    hits = sum(row["hit_rate_by_tier"].values())
    assert hits == pytest.approx(row["pd_pages_skipped"] / row["prompt_pages"])


def test_pd_row_refuses_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_llama(tmp_path / "tiny", seed=4)
    args = [
        "run",
        "--quick",
        "--pd",
        "--model",
        str(ckpt),
        "--out",
        str(tmp_path / "o"),
        "--tp",
        "2",
    ]
    assert main(args) == 2
    assert "--pd runs one-rank P/D workers" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

"""Simulator: TTFT decomposition, cost model against hand computations, clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import kvstrata.cli.main as cli
from kvstrata.bench.costmodel import CostModel, Topology, pipelined
from kvstrata.bench.hardware import get_model, get_profile
from kvstrata.bench.replay import ReplayConfig
from kvstrata.bench.simulate import TERMS, Outcome, fifo, no_cache
from kvstrata.bench.whatif import ROWS, whatif
from kvstrata.workloads.trace import write_mooncake
from tests.test_replay import small_trace

MODEL, HW = get_model("llama-3.1-8b"), get_profile("h100-nvme")


@pytest.mark.parametrize("topo", ["tp1", "tp2-cp2", "tp4-pp2-pd", "tp8-cp2-pd"])
def test_decomposition_adds_up_and_cache_off_has_no_hit_terms(topo: str) -> None:
    trace = small_trace(80, seed=3)
    cfg = ReplayConfig.sized(4096, 8192, "mem://")
    report, timings = whatif(trace, MODEL, HW, Topology.parse(topo), cfg, time_scale=0.01)
    assert len(timings) == 80
    for t in timings:
        assert math.isclose(sum(t.terms.values()), t.ttft_s, rel_tol=1e-12, abs_tol=1e-15)
        assert all(v >= 0 for v in t.terms.values())
    assert report["decomposition"]["prefetch_s"] + report["decomposition"]["load_s"] > 0
    off = fifo(
        no_cache([Outcome(i, 0.01 * i, 3000, 1000, 1000, 512) for i in range(20)]),
        CostModel(MODEL, HW, Topology.parse(topo)),
    )
    assert all(t.terms["load_s"] == 0 and t.terms["prefetch_s"] == 0 for t in off)
    assert set(report["ablation"]) == set(ROWS)
    cells = report["ablation"]
    for label in cells["off"]:  # cache reuse never hurts here: compute dominates the transfers
        assert (
            cells["device+host+storage"][label]["ttft_mean_s"] < cells["off"][label]["ttft_mean_s"]
        )


def test_compute_time_matches_hand_computed_flops() -> None:
    cost = CostModel(MODEL, HW, Topology(tp=2))
    c = cost.costs(10_000, 4000, 0, 0)
    pairs = sum(t + 1 for t in range(4000, 10_000))
    flops = 2 * 8.03e9 * 6000 + 4 * 32 * 32 * 128 * pairs
    assert math.isclose(c.compute_s, flops / (2 * 989.5e12 * 0.5), rel_tol=1e-12)
    assert c.load_s == c.prefetch_s == c.gather_s == c.pd_transfer_s == 0


def test_transfer_terms_follow_bytes_and_links() -> None:
    cost = CostModel(MODEL, HW, Topology())
    kv = 2 * 32 * 8 * 128 * 2  # bytes per token
    c = cost.costs(5000, 0, 0, 4096)
    assert math.isclose(
        c.prefetch_s, HW.storage.latency_s + 4096 * kv / HW.storage.bandwidth, rel_tol=1e-12
    )
    load = HW.host_link.latency_s + 4096 * kv / HW.host_link.bandwidth
    assert c.load_s >= load / 32 - 1e-15 and c.load_s <= load


def test_fifo_queueing_and_prefetch_overlap() -> None:
    cost = CostModel(MODEL, HW, Topology())
    a = cost.costs(8000, 0, 0, 0)
    outs = [Outcome(0, 0.0, 8000), Outcome(1, 0.0, 8000, 0, 0, 4096)]
    t0, t1 = fifo(outs, cost)
    assert t0.terms["queue_s"] == 0 and math.isclose(t0.ttft_s, a.compute_s)
    assert math.isclose(t1.terms["queue_s"], a.busy_s)  # waited for request 0
    assert t1.terms["prefetch_s"] == 0  # the prefetch finished while it queued


def test_bad_hardware_and_topologies_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu-v9'.*h100-nvme"):
        get_profile("tpu-v9")
    with pytest.raises(ValueError, match="tp=3 does not divide llama-3.1-8b's 8 KV heads"):
        CostModel(MODEL, HW, Topology(tp=3))
    with pytest.raises(ValueError, match="pp=40 exceeds llama-3.1-8b's 32 layers"):
        CostModel(MODEL, HW, Topology(pp=40))
    with pytest.raises(ValueError, match="weights do not fit"):
        CostModel(get_model("llama-3.1-70b"), HW, Topology()).capacity_tokens()
    with pytest.raises(ValueError, match="not tpN"):
        Topology.parse("tp2-xx3")


def test_cli_simulate_and_replay_write_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    mods = ("kvstrata.cli.replay_cmd", "kvstrata.cli.simulate_cmd")
    monkeypatch.setattr(cli, "COMMAND_MODULES", tuple(dict.fromkeys(cli.COMMAND_MODULES + mods)))
    cli_main = cli.main
    path = tmp_path / "t.jsonl"
    write_mooncake(small_trace(40).requests, path)
    sim = tmp_path / "sim.json"
    rc = cli_main(
        [
            "simulate",
            str(path),
            "--hardware",
            "a100-nvme",
            "--tp",
            "2",
            "--cp",
            "2",
            "--device-tokens",
            "4096",
            "--host-tokens",
            "8192",
            "--json",
            str(sim),
        ]
    )
    assert rc == 0
    rep = json.loads(sim.read_text())
    for key in ("ttft_p50_s", "decomposition", "ablation"):
        assert key in rep
    assert set(rep["decomposition"]) == set(TERMS) and rep["decomposition"]["gather_s"] > 0
    rj, png = tmp_path / "r.json", tmp_path / "r.png"
    assert (
        cli_main(
            ["replay", str(path), "--json", str(rj), "--png", str(png), "--device-pages", "64"]
        )
        == 0
    )
    assert json.loads(rj.read_text())["requests"] == 40 and png.stat().st_size > 1000
    assert "tokens/s" in capsys.readouterr().out
    assert cli_main(["simulate", str(path), "--hardware", "nope"]) == 2
    assert cli_main(["simulate", str(path), "--hardware", "h100-nvme", "--tp", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_pd_sends_only_what_the_decode_worker_lacks() -> None:
    """Decode holds the cached prefix (any tier): prefill sends the rest, exactly those bytes."""
    kv = 2 * 32 * 8 * 128 * 2  # llama-3.1-8b bf16: bytes per token
    pd, plain = CostModel(MODEL, HW, Topology(tp=2, pd=True)), CostModel(MODEL, HW, Topology(tp=2))
    c = pd.costs(10_000, 4000, 1000, 2000)
    assert c.pd_bytes == 3000 * kv  # 10k prompt, 7k held
    send = HW.inter_node.time(3000 * kv, lanes=2)
    assert c.pd_transfer_s == pipelined(send, c.compute_s, MODEL.num_layers)
    assert plain.costs(10_000, 4000, 1000, 2000).pd_bytes == 0
    assert pd.costs(10_000, 0, 0, 0).pd_bytes == 10_000 * kv  # cold: every token's KV


def test_cli_simulate_pd_reports_bytes_sent(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, sim = tmp_path / "t.jsonl", tmp_path / "sim.json"
    write_mooncake(small_trace(40).requests, path)
    args = ["simulate", str(path), "--hardware", "h100-nvme", "--tp", "2", "--pd"]
    assert (
        cli.main([*args, "--device-tokens", "4096", "--host-tokens", "8192", "--json", str(sim)])
        == 0
    )
    rep = json.loads(sim.read_text())
    assert 0 < rep["pd_bytes_sent"] < rep["pd_bytes_whole_prompts"]
    # the main row is device+host+storage: decode lacks exactly the tokens that row missed
    assert math.isclose(rep["pd_bytes_sent_ratio"], 1 - rep["hit_rate"], rel_tol=1e-12)
    assert rep["ablation"]["off"]["tp2-pd"]["pd_bytes_sent"] == rep["pd_bytes_whole_prompts"]
    assert rep["ablation"]["device+host+storage"]["tp2"]["pd_bytes_sent"] == 0
    assert "P/D KV bytes sent" in capsys.readouterr().out

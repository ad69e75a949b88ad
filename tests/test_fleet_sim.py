"""`simulate --replicas`: a fleet of real caches behind the routing rule. One replica is exactly
the single-cache replay; kv_aware keeps each prefix tree on one replica (the trace's ceiling with
no shared store) where round robin scatters it; the load term spreads a hot prompt."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import kvstrata.cli.main as cli
from kvstrata.bench.costmodel import CostModel, Topology
from kvstrata.bench.fleet_sim import ROUTINGS, simulate_fleet
from kvstrata.bench.hardware import get_model, get_profile
from kvstrata.bench.replay import ReplayConfig, replay
from kvstrata.bench.simulate import fifo, summarize
from kvstrata.workloads.trace import Trace, TraceRequest, write_mooncake
from tests.test_replay import small_trace

COST = CostModel(get_model("llama-3.1-8b"), get_profile("h100-nvme"), Topology())
ROOMY = ReplayConfig.sized(1 << 16, 1 << 17, "mem://")  # no eviction on these traces


def test_one_replica_is_the_single_cache_replay_under_either_arm() -> None:
    trace = small_trace(60, seed=5)
    single = replay(trace, ROOMY).report()
    small = ReplayConfig.sized(1536, 4096, "mem://")  # spills to host and storage
    spilled = replay(trace, small)
    for arm in ROUTINGS:
        row = simulate_fleet(trace, ROOMY, COST, 1, arm)
        assert row["hit_rate_by_tier"] == single["hit_rate_by_tier"]
        assert row["ceiling"] == single["ceiling"] and row["requests_per_replica"] == [60]
        row = simulate_fleet(trace, small, COST, 1, arm, time_scale=0.5)
        rep = spilled.report()
        assert row["hit_rate_by_tier"] == rep["hit_rate_by_tier"]  # host and storage hits too
        assert rep["hit_rate_by_tier"]["host"] > 0
        assert row["ttft_p50_s"] == summarize(fifo(spilled.outcomes, COST, 0.5))["ttft_p50_s"]


def test_kv_aware_keeps_each_prefix_tree_on_one_replica() -> None:
    # no session identities and idle replicas: a prompt held nowhere goes to the same replica
    # each time (the rule's tie), a prompt held somewhere to the replica holding it
    trace = small_trace(60, seed=5)
    local = dataclasses.replace(ROOMY, cache=dataclasses.replace(ROOMY.cache, storage_url=""))
    aware = simulate_fleet(trace, local, COST, 4, "kv_aware", time_scale=10.0)  # idle replicas
    spread = simulate_fleet(trace, local, COST, 4, "round_robin", time_scale=10.0)
    assert aware["hit_rate"] == aware["ceiling"] > spread["hit_rate"]
    assert spread["requests_per_replica"] == [15, 15, 15, 15]
    shared = simulate_fleet(trace, ROOMY, COST, 4, "round_robin", time_scale=10.0)
    assert shared["hit_rate_by_tier"]["storage"] > 0  # the shared store saves round robin


def test_the_load_term_spreads_a_hot_prompt() -> None:
    hot = [TraceRequest(i, 0.0, 2000, 4, hash_ids=(0, 1, 2, 3)) for i in range(40)]
    row = simulate_fleet(Trace(hot, "hot"), ROOMY, COST, 4, "kv_aware")
    assert row["busiest_over_mean"] <= 1.3  # all on the one holding it would be 4.0
    assert row["hit_rate"] == row["ceiling"]  # and every replica it spread to still hits


def test_cli_simulate_replicas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    mods = ("kvstrata.cli.simulate_cmd",)
    monkeypatch.setattr(cli, "COMMAND_MODULES", tuple(dict.fromkeys(cli.COMMAND_MODULES + mods)))
    path, out = tmp_path / "t.jsonl", tmp_path / "fleet.json"
    write_mooncake(small_trace(30).requests, path)
    args = ["simulate", str(path), "--hardware", "h100-nvme", "--device-tokens", "4096"]
    assert cli.main([*args, "--replicas", "1,3", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [(r["replicas"], r["routing"]) for r in rep["rows"]] == [
        (n, arm) for n in (1, 3) for arm in ROUTINGS
    ]
    assert [t["replicas"] for t in rep["trend"]["kv_aware"]] == [1, 3]
    assert rep["trend"]["kv_aware"][0]["hit_rate_ratio"] == 1.0
    assert cli.main([*args, "--replicas", "65"]) == 2
    assert cli.main([*args, "--replicas", "2", "--routing", "random"]) == 2
    err = capsys.readouterr().err
    assert "--replicas: each N must be in 1..64" in err and "--routing: unknown arm" in err

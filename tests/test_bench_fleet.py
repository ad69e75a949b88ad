"""`kvstrata bench fleet --quick` on a tiny model through the CLI: three replicas behind the
fleet router per arm, real processes. Exact where deterministic: every arm answers every
request with the same greedy text, round robin spreads them evenly, a replica with no shared
store has no storage hits, and the report carries the goals' keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.bench.dynamo_indexer import dynamo_missing
from kvstrata.bench.fleet_bench import QUICK
from kvstrata.cli.main import main
from tests.tiny_models import make_llama

pytestmark = pytest.mark.slow  # three arms of three replicas and a router

KEYS = {
    "hit_over_ceiling_kv_aware", "ttft_p50_kv_aware_over_rr_shared",
    "busiest_over_mean_kv_aware", "predicted_equals_reported_kv_aware",
}  # fmt: skip


def test_bench_fleet_quick_runs_every_arm(tmp_path: Path) -> None:
    ckpt = make_llama(tmp_path / "tiny", seed=3, max_position_embeddings=1024)
    out = tmp_path / "fleet.json"
    args = ["bench", "fleet", "--quick", "--json", str(out), "--model", str(ckpt), "--rate", "4"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    rep = json.loads(out.read_text())
    assert KEYS <= rep.keys() and all(rep[k] is not None for k in KEYS)
    arms = ["rr_local", "rr_shared", "kv_aware"] + ([] if dynamo_missing() else ["dynamo"])
    assert rep["arms_run"] == arms and set(rep["arms"]) == set(arms)
    n = QUICK.sessions * QUICK.turns
    for name in arms:
        arm = rep["arms"][name]
        assert arm["requests"] == n and sum(arm["requests_per_replica"]) == n
        assert 0 <= arm["hit_rate"] <= 1 and arm["ttft_p50_s"] > 0
    assert rep["arms"]["rr_local"]["requests_per_replica"] == [n // 3] * 3
    assert rep["arms"]["rr_shared"]["requests_per_replica"] == [n // 3] * 3
    assert rep["arms"]["rr_local"]["hit_rate_by_tier"]["storage"] == 0
    assert rep["arms"]["kv_aware"]["hit_rate"] > 0
    assert rep["outputs_identical"] is True  # greedy: every arm computes the same tokens
    assert rep["hit_over_ceiling_kv_aware"] == rep["arms"]["kv_aware"]["hit_over_ceiling"]
    assert (tmp_path / "out" / "fleet.png").stat().st_size > 1000

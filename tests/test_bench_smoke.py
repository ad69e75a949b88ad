"""Every registered `kvstrata bench NAME` runs in its --quick form through the CLI and writes the
JSON keys its readers rely on. No timing is asserted here: benchmarks report, tests check shape.

A bench registered without an entry in QUICK is skipped with a reason naming it, so a new bench
shows up in the test report until someone adds its keys here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.bench.registry import load_benches
from kvstrata.cli.main import main

# name -> (keys its --quick JSON must hold, runs the real SmolLM2 model)
QUICK: dict[str, tuple[frozenset[str], bool]] = {
    "radix": (
        frozenset(
            {
                "insert_s",
                "match_s",
                "classic_insert_s",
                "classic_match_s",
                "insert_speedup_vs_classic",
                "match_speedup_vs_classic",
                "total_speedup_vs_classic",
                "hash_ns_per_token",
                "metadata_bytes_per_page",
            }
        ),
        False,
    ),
    "transfer": (
        frozenset({"baseline_s", "load_s", "store_s", "load_ratio", "store_ratio", "bit_exact"}),
        False,
    ),
    "storage": (
        frozenset(
            {
                "put_ratio",
                "get_ratio",
                "put_gbps",
                "get_gbps",
                "by_page_size",
                "file_probe_ms",
                "mooncake_put_ratio",
                "mooncake_get_ratio",
                "mooncake_probe_ms",
                "mooncake_probe_base_ms",
                "redis_put_ratio",
                "redis_get_ratio",
                "redis_probe_ms",
                "sealed",
            }
        ),
        False,
    ),
    "consensus": (
        frozenset({"collectives_per_step", "step_consensus_ms_p50", "speedup_p50"}),
        False,
    ),
    "ttft": (
        frozenset(
            {"cold_ttft_s", "device_ratio", "host_ratio", "storage_ratio", "first_tokens_identical"}
        ),
        True,
    ),
    "prefill": (
        frozenset(
            {
                "prefill_ratio_vs_hf_512",
                "prefill_ratio_vs_hf_1k",
                "decode_ratio_vs_hf",
                "hit_ttft_1k_s",
                "same_tokens_as_hf",
                "cold_256_ours_ms_per_token",
                "cold_256_ours_vs_hf",
                "cached_64_over_256_ours_ms_per_token",
                "cached_64_over_256_ours_vs_hf",
            }
        ),
        True,
    ),
    "admission": (
        frozenset(
            {
                "device_hit_ttft_p50_s_head_blocks",
                "device_hit_ttft_p50_s_lookahead",
                "device_hit_ttft_ratio",
                "long_ttft_s_head_blocks",
                "long_ttft_s_lookahead",
                "long_storage_pages",
            }
        ),
        False,
    ),
    "mla": (
        frozenset(
            {
                "speedup_absorbed_vs_plain",
                "max_rel_diff",
                "latent_bytes_per_token_layer",
                "kv_heads_bytes_per_token_layer",
            }
        ),
        False,
    ),
    "vllm_copies": (
        frozenset(
            {
                f"{k}_{blocks}"
                for k in (
                    "copies_only_ratio_layer_vs_step",
                    "with_compute_ratio_layer_vs_step",
                    "with_compute_ms_step",
                    "with_compute_ms_layer",
                )
                for blocks in ("scattered", "consecutive")
            }
        ),
        False,
    ),
    "replay_flood": (
        frozenset(
            {
                "ttft_quiet_s",
                "ttft_flood_s",
                "ttft_quiet_after_s",
                "flood_over_quiet",
                "flooder_sent",
                "flooder_answered",
                "flooder_cpu_s",
            }
        ),
        True,
    ),
}
COVERED_ELSEWHERE = {
    "serve": "tests/test_bench_serve.py",
    "spec": "tests/test_bench_spec.py",
    "parallel": "tests/test_parallel_kv.py",
    "pd": "tests/test_bench_pd.py",
    "fleet": "tests/test_bench_fleet.py",
    "sglang": "tests/test_sglang_storage.py",
    "vllm": "tests/test_bench_vllm.py",
    "decode": "tests/test_bench_serve.py",
    "agent": "tests/test_bench_agent.py",
}
"""Benches whose --quick run has its own test (they need servers, ranks or a draft)."""


def test_every_bench_has_a_smoke_run() -> None:
    missing = set(load_benches().names()) - set(QUICK) - set(COVERED_ELSEWHERE)
    assert not missing, f"benches without a --quick test: {sorted(missing)}"


def _params() -> list[object]:
    out: list[object] = []
    for name in load_benches().names():
        if name in COVERED_ELSEWHERE:
            continue
        slow = name in QUICK and QUICK[name][1]
        out.append(pytest.param(name, marks=pytest.mark.slow) if slow else name)
    return out


@pytest.mark.parametrize("name", _params())
def test_quick_bench_writes_its_keys(name: str, tmp_path: Path) -> None:
    if name not in QUICK:
        pytest.skip(f"bench {name!r}: no quick smoke entry in tests/test_bench_smoke.py QUICK")
    keys, _ = QUICK[name]
    out = tmp_path / f"{name}.json"
    assert main(["bench", name, "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert keys <= report.keys(), f"missing: {sorted(keys - report.keys())}"
    for key in keys:  # every figure is a real number: no NaN, no placeholder
        value = report[key]
        if isinstance(value, float):
            assert value == value and value >= 0.0, (key, value)
    if name in ("prefill", "ttft"):  # the same model gives the same greedy tokens on every path
        assert report.get("same_tokens_as_hf", report.get("first_tokens_identical")) is True
    if name == "transfer":
        assert report["bit_exact"] is True
    if name == "mla":  # the two exact ways agree
        assert report["max_rel_diff"] <= 1e-5

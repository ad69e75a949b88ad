"""`kvstrata run` end to end on a tiny random Llama: all four tier sets, the report, the plot,
storage hits carried into a second run, and bad input rejected before the store is touched."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvstrata.cli.main import main
from kvstrata.cli.run_cmd import QUICK
from kvstrata.workloads.agent import WorkloadSpec, build_workload

torch.set_num_threads(1)
TINY = ["--page-size", "8", "--chunk-tokens", "64", "--max-batch-tokens", "128"]


CKPT = {"seed": 1, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def run_args(ckpt: Path, out: Path, *extra: str) -> list[str]:
    # --no-pd: the pd row's three processes are tested in test_pd_run_row.py
    return ["run", "--quick", "--no-pd", "--model", str(ckpt), "--out", str(out), *TINY, *extra]


PAGE = 8
PAGE_BYTES = 2 * 2 * 2 * PAGE * 16 * 4  # layers x (K, V) x K/V heads x page x head dim x fp32


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ceiling_hits() -> list[int]:
    """Hit pages per request (report order: session, turn) with unbounded capacity, from the
    prompts alone: a turn can hit the full pages it shares with its session's earlier prompts,
    within its hittable pages (the last prompt token is always computed)."""
    prompts = build_workload(dataclasses.replace(QUICK, seed=0), 97)
    for s, other in ((0, 1), (1, 0)):  # sessions share less than a page: no hit across them
        assert max(_lcp(p, q) for p in prompts[s] for q in prompts[other]) < PAGE
    hits = []
    for session in prompts:
        for t, cur in enumerate(session):
            shared = max((_lcp(cur, prev) for prev in session[:t]), default=0)
            hits.append(min(shared // PAGE, (len(cur) - 1) // PAGE))
    return hits


def tier_hits(rep: dict, tier: str | None = None) -> list[int]:
    return [sum(r["hits"].values()) if tier is None else r["hits"][tier] for r in rep["requests"]]


def check_bytes_follow_hits(rep: dict) -> None:
    """Every host or storage hit page crossed host->device once; every storage hit page crossed
    storage->host once.

    A page read from storage may count as a host hit: a waiting request whose lease stepped back
    (engine/admission.py: `_step_back`, when the request ahead does not fit) matches anew,
    and the pages its first lease's prefetch landed are then host pages to the new lease. Whether
    that happens depends on when the storage reads finish (seen once under a loaded suite:
    84 pages read, 74 counted as storage hits), so that bound is a range; the exact totals are the
    caller's (storage->host bytes == what the first run stored)."""
    moved = rep["bytes_moved"]
    host, storage = sum(tier_hits(rep, "host")), sum(tier_hits(rep, "storage"))
    assert moved["host->device"] == (host + storage) * PAGE_BYTES
    assert storage * PAGE_BYTES <= moved["storage->host"] <= (host + storage) * PAGE_BYTES


def test_workload_is_deterministic_and_grows() -> None:
    spec = WorkloadSpec(sessions=2, turns=3, first_lines=3, tool_lines=2)
    a, b = build_workload(spec, 97), build_workload(spec, 97)
    assert a == b
    for session in a:
        for prev, cur in zip(session, session[1:], strict=False):
            assert len(cur) > len(prev) and cur[: len(prev)] == prev  # the history only grows
    assert a[0] != a[1]  # sessions differ
    assert all(0 <= t < 97 for s in a for p in s for t in p)


def test_run_all_configs_then_storage_hits_in_second_run(
    ckpt: Path, tmp_path: Path, capsys
) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    assert main(run_args(ckpt, out)) == 0
    printed = capsys.readouterr().out
    assert "identical" in printed and "report.json" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["outputs_identical"] is True
    assert set(report["configs"]) == {"none", "device", "device_host", "device_host_storage"}
    for rep in report["configs"].values():
        for key in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "bytes_moved", "requests"):
            assert key in rep
        assert set(rep["hit_rate_by_tier"]) == {"device", "host", "storage"}
        assert len(rep["requests"]) == 6
    cfg = report["configs"]
    best = ceiling_hits()
    assert [(r["session"], r["turn"]) for r in cfg["device"]["requests"]] == [
        (s, t) for s in range(2) for t in range(3)
    ]
    assert tier_hits(cfg["none"]) == [0] * 6
    # device memory alone is sized to spill (3/4 of the sessions' pages): it keeps part of the
    # history ...
    device = tier_hits(cfg["device"], "device")
    assert all(h <= b for h, b in zip(device, best, strict=True)) and sum(device) < sum(best)
    # ... and with host memory behind it (room for everything) every shareable page is a hit.
    for name in ("device_host", "device_host_storage"):
        assert tier_hits(cfg[name]) == best
        assert (
            sum(tier_hits(cfg[name], "host")) == sum(best) - sum(tier_hits(cfg[name], "device")) > 0
        )
        check_bytes_follow_hits(cfg[name])
        assert cfg[name]["bytes_moved"]["storage->host"] == 0  # the store starts empty
    stored = cfg["device_host"]["bytes_moved"]["device->host"]
    assert (
        stored % PAGE_BYTES == 0
        and cfg["device_host_storage"]["bytes_moved"]["host->storage"] == stored
    )
    assert (out / "ttft.png").stat().st_size > 1000
    assert any((out / "store").iterdir())

    assert main(run_args(ckpt, out)) == 0  # a new engine, the same file store
    again = json.loads((out / "report.json").read_text())
    warm = again["configs"]["device_host_storage"]
    hittable = [(r["prompt_tokens"] - 1) // PAGE for r in warm["requests"]]
    assert tier_hits(warm) == hittable  # every page the first run stored comes back
    first_turns = [r for r in warm["requests"] if r["turn"] == 0]
    assert [r["hits"]["storage"] for r in first_turns] == [hittable[0], hittable[3]]
    assert warm["bytes_moved"]["storage->host"] == stored  # exactly what the first run backed up
    check_bytes_follow_hits(warm)
    assert again["outputs_identical"] is True
    assert [r["output"] for r in again["configs"]["none"]["requests"]] == [
        r["output"] for r in report["configs"]["none"]["requests"]
    ]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--prompt", ""], "empty"),
        (["--prompt", "x" * 600], "positions"),
        (["--storage-url", "ftp://host/dir"], "scheme"),
        (["--tp", "3"], "--tp 3 must divide"),  # the tiny model has 4 query / 2 K/V heads
        (["--pp", "9"], "--pp 9 must be in"),
        (["--cp", "2", "--device-pages", "61"], "multiple of --cp"),
    ],
)
def test_bad_input_exits_with_one_line(ckpt: Path, tmp_path: Path, capsys, extra, needle) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    assert main(run_args(ckpt, out, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err
    assert not out.exists()  # nothing written: no store, no report


def test_model_path_that_is_not_a_checkpoint(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    (tmp_path / "notamodel").mkdir()
    assert main(["run", "--quick", "--model", str(tmp_path / "notamodel"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint" in err
    assert not out.exists()


def test_run_on_two_tensor_parallel_ranks_matches_one_rank(ckpt: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    one_args = ("--sessions", "1", "--turns", "2", "--consensus-log", str(logs / "one"))
    assert main(run_args(ckpt, tmp_path / "one", *one_args)) == 0
    tp_args = ("--sessions", "1", "--turns", "2", "--tp", "2", "--consensus-log", str(logs / "tp"))
    assert main(run_args(ckpt, tmp_path / "tp", *tp_args)) == 0
    one = json.loads((tmp_path / "one" / "report.json").read_text())
    tp = json.loads((tmp_path / "tp" / "report.json").read_text())
    assert tp["outputs_identical"]
    for name in ("none", "device_host_storage"):
        outs = [r["output"] for r in one["configs"][name]["requests"]]
        assert [r["output"] for r in tp["configs"][name]["requests"]] == outs
    for name in (
        "device",
        "device_host",
        "device_host_storage",
    ):  # the same cache decisions, request by request
        assert [r["hits"] for r in tp["configs"][name]["requests"]] == [
            r["hits"] for r in one["configs"][name]["requests"]
        ]
    assert sum(tier_hits(tp["configs"]["device"], "device")) > 0  # the case is not vacuous
    assert all(r["ttft_s"] > 0 for r in tp["configs"]["none"]["requests"])  # wall time, per rank
    for tiers in (
        "none",
        "device",
        "device_host",
        "device_host_storage",
    ):  # each configuration logged, ranks agree
        assert (logs / "one" / tiers / "rank-0.jsonl").stat().st_size > 0
        assert main(["check-consensus", str(logs / "tp" / tiers)]) == 0


def test_live_check_stops_the_run_at_an_injected_divergence(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ("--sessions", "1", "--turns", "2", "--tp", "2", "--consensus-check", "live")
    code = main(run_args(ckpt, tmp_path / "out", *extra, "--inject-divergence", "5:1"))
    err = capsys.readouterr().err
    assert code == 1
    assert "consensus diverged at step 5" in err and "rank 1 differs" in err
    assert "Traceback" not in err

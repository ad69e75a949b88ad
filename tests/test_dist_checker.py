"""DecisionLog digests and the offline checker / `check-consensus` CLI (in-process, no ranks)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvstrata.cli import check_consensus_cmd
from kvstrata.ranks.checker import LogError, check_logs, split_majority
from kvstrata.ranks.config import DistConfig, parse_injection
from kvstrata.ranks.decision_log import DecisionLog, chain_digest, key_prefix


def _cli(directory: Path, *extra: str) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    check_consensus_cmd.register(sub)
    args = parser.parse_args(["check-consensus", str(directory), *extra])
    return int(args.func(args))


def _run_log(log: DecisionLog, steps: int) -> list[int]:
    """A deterministic decision stream, as a scheduler would make on every rank."""
    digests = []
    for step in range(steps):
        if not log.should_skip(step):
            pass  # the consumer would apply the decision here
        log.record("load", pages=[step, step + 1], n=2)
        log.record("evict", keys=[key_prefix(step * 7919 + 1)])
        if step % 3 == 0:
            log.record("backup", pages=list(range(step)))
        digests.append(log.end_step(step))
    log.close()
    return digests


def _write_logs(tmp: Path, world: int, steps: int, inject: str = "") -> list[list[int]]:
    cfg = DistConfig(tp=world, consensus_log=str(tmp), inject_divergence=inject)
    return [_run_log(DecisionLog.from_config(cfg, r), steps) for r in range(world)]


def test_digest_is_deterministic_and_order_sensitive() -> None:
    a, b = DecisionLog(0), DecisionLog(1)
    for log in (a, b):
        log.record("x", pages=[1, 2])
        log.record("y", n=3)
    assert a.end_step() == b.end_step() and 0 < a.digest < 2**63
    c = DecisionLog(0)
    c.record("y", n=3)
    c.record("x", pages=[1, 2])
    assert c.end_step() != a.digest
    assert chain_digest(0, b"abc") == chain_digest(0, b"abc") != chain_digest(1, b"abc")


def test_injected_skip_changes_the_digest_from_that_step_only(tmp_path: Path) -> None:
    digests = _write_logs(tmp_path, 3, 8, inject="4:1")
    assert digests[0] == digests[2]
    assert digests[1][:4] == digests[0][:4]
    assert all(digests[1][s] != digests[0][s] for s in range(4, 8))


def test_agreeing_logs_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_logs(tmp_path, 3, 10)
    assert _cli(tmp_path, "--json", str(tmp_path / "out" / "r.json")) == 0
    assert "all 3 ranks agree over 10 steps" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "r.json").read_text())["ok"] is True


def test_divergence_names_step_decision_and_minority(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_logs(tmp_path, 3, 10, inject="6:2")
    assert _cli(tmp_path) == 1
    out = capsys.readouterr().out
    assert "diverged at step 6: rank 2 diverged from the majority (ranks 0, 1)" in out
    assert 'ranks 0, 1: load {"n":2,"pages":[6,7]}' in out
    assert "first differing decision: #0 of step 6" in out
    result = check_logs(tmp_path)
    assert result.divergence is not None and result.divergence.minority == [2]


def test_two_ranks_name_both_and_the_one_differing_from_rank_0(tmp_path: Path) -> None:
    _write_logs(tmp_path, 2, 5, inject="3:0")
    div = check_logs(tmp_path).divergence
    assert div is not None and div.step == 3
    assert "ranks 0 and 1 disagree; rank 1 differs from rank 0" in div.text()
    # The skipped record: rank 0 logged "evict" first where rank 1 logged "load".
    assert div.decisions[0].startswith("evict") and div.decisions[1].startswith("load")


def test_missing_empty_and_corrupt_logs_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(tmp_path / "nope") == 2
    assert "no such log directory" in capsys.readouterr().err
    assert _cli(tmp_path) == 2
    assert "no rank logs" in capsys.readouterr().err
    _write_logs(tmp_path, 2, 3)
    (tmp_path / "rank-1.jsonl").unlink()
    assert _cli(tmp_path) == 2
    assert "logs of ranks [1] are missing" in capsys.readouterr().err
    _write_logs(tmp_path, 2, 3)
    text = (tmp_path / "rank-1.jsonl").read_text().replace('"n":2', '"n":3', 1)
    (tmp_path / "rank-1.jsonl").write_text(text)
    with pytest.raises(LogError, match="rank-1.jsonl"):
        check_logs(tmp_path)


def test_a_log_that_ends_early_is_named(tmp_path: Path) -> None:
    _write_logs(tmp_path, 2, 6)
    log = DecisionLog(1, tmp_path, world_size=2)
    _run_log(log, 4)  # rank 1 "died" after step 3
    result = check_logs(tmp_path)  # a stopped rank, not a diverged one
    assert result.divergence is None and result.stopped == {1: 3} and not result.ok
    assert "rank 1's log ends at step 3 (rank stopped?)" in result.text()


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="inject_divergence"):
        parse_injection("3")
    with pytest.raises(ValueError, match="inject_divergence rank 4"):
        DistConfig(tp=2, inject_divergence="1:4")
    with pytest.raises(ValueError, match="consensus_check"):
        DistConfig(consensus_check="sometimes")
    with pytest.raises(ValueError, match="cp"):
        DistConfig(cp=0)
    with pytest.raises(TypeError, match="payload field 'bad'"):
        DecisionLog(0).record("x", bad={"a": 1})
    log = DecisionLog(0)
    log.record("x")
    with pytest.raises(ValueError, match="end_step"):
        log.end_step(5)
    assert split_majority({0: 1, 1: 2}) == ([0], [1])
    assert split_majority({0: 1, 1: 2, 2: 2}) == ([1, 2], [0])

"""Fault suite, runs and ranks: SIGTERM of a multi-rank run in the
middle of its storage backups, a killed rank, an injected divergence under default settings, and
decision logs that are mixed, truncated or undecodable."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstrata.cli.main import main
from kvstrata.ranks.decision_log import DecisionLog
from kvstrata.ranks.group import RankContext
from kvstrata.storage.file_store import FileStore

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--page-size", "8", "--chunk-tokens", "64", "--max-batch-tokens", "128"]


CKPT = {"seed": 1, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def start_run(ckpt: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "run", "--quick", "--model", str(ckpt)]
    return subprocess.Popen(
        [*cmd, "--out", str(out), *TINY, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the test signals the whole run
    )


def wait_for_pages(store: Path, proc: subprocess.Popen[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not list(store.glob("*/*.kvp")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run wrote no storage page"
        time.sleep(0.01)


def read_until(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> tuple[str, float]:
    """stderr up to the first line holding `needle`, and the monotonic time it came."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return "".join(lines), time.monotonic()
    raise AssertionError(f"no {needle!r} on stderr: {''.join(lines)}")


def group_alive(pgid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return out.split()


def check_store(store: Path) -> None:
    """No temp file left, every page file verifies under its own name."""
    assert list(store.glob("*/.*.tmp")) == []
    files = list(store.glob("*/*.kvp"))
    assert files
    nbytes = files[0].stat().st_size - 40
    s = FileStore(f"file://{store}", nbytes)
    s.check_integrity()
    import numpy as np

    out = np.empty(nbytes, np.uint8)
    for f in files:
        assert s.get([int(f.stem, 16)], [out]) == 1, f
    s.close()


@pytest.mark.slow
def test_sigterm_of_a_two_rank_run_mid_backup(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start_run(ckpt, out, "--tp", "2")
    wait_for_pages(out / "store", proc)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert (
        "Traceback" not in err
        and lines[-1] == "kvstrata run: terminated (SIGTERM); stopped cleanly"
    ), err
    time.sleep(0.5)
    assert group_alive(proc.pid) == []  # the ranks were reaped
    check_store(out / "store")


@pytest.mark.slow
def test_a_killed_rank_is_named_within_the_timeout(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start_run(ckpt, out, "--tp", "2", "--timeout-s", "10", "--sessions", "6")
    wait_for_pages(out / "store", proc)
    kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    victim = int(kids.split()[-1])
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    err, took = read_until(proc, "ranks stopped", 60)
    assert took - t0 < 10, f"ranks stopped after {took - t0:.1f} s, --timeout-s 10"
    err += proc.communicate(timeout=30)[1]
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert "died (killed by SIGKILL)" in err
    assert len([ln for ln in err.splitlines() if "rank" in ln]) <= 2  # one line per rank
    assert group_alive(proc.pid) == []


@pytest.mark.slow
def test_a_stopped_rank_is_named_hung_within_the_timeout(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start_run(ckpt, out, "--tp", "2", "--timeout-s", "10", "--sessions", "6")
    wait_for_pages(out / "store", proc)
    kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    victim = int(kids.split()[-1])
    os.kill(victim, signal.SIGSTOP)  # alive but silent: a hung rank
    t0 = time.monotonic()
    try:
        err, took = read_until(proc, "ranks stopped", 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)  # reaped already when the run did its job
    # every rank is reaped before that line is printed; the interpreter's own exit comes after
    assert took - t0 < 10, f"ranks stopped after {took - t0:.1f} s, --timeout-s 10"
    err += proc.communicate(timeout=30)[1]
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert "(hung)" in err and "no answer" in err
    assert group_alive(proc.pid) == []


@pytest.mark.slow
def test_injected_divergence_stops_every_rank_by_default(
    ckpt: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """No --consensus-check option: the live digest is on by default ."""
    logs = tmp_path / "logs"
    extra = ("--sessions", "1", "--turns", "2", "--tp", "2", "--inject-divergence", "5:1")
    t0 = time.monotonic()
    code = main(
        [
            "run",
            "--quick",
            "--model",
            str(ckpt),
            "--out",
            str(tmp_path / "o"),
            *TINY,
            *extra,
            "--consensus-log",
            str(logs),
        ]
    )
    assert code == 1 and time.monotonic() - t0 < 60
    err = capfd.readouterr().err  # the ranks' stderr too (file descriptor 2)
    assert "Traceback" not in err, err
    assert "ranks stopped: consensus diverged at step 5" in err and "rank 1 differs" in err
    headers = [
        json.loads((logs / "device" / f"rank-{r}.jsonl").read_text().splitlines()[0])
        for r in (0, 1)
    ]
    assert (
        headers[0]["run"] == headers[1]["run"] != ""
        and headers[0]["config"] == headers[1]["config"]
    )


def write_log(directory: Path, rank: int, steps: int, run: str, world: int = 2) -> None:
    log = DecisionLog(rank, directory, world_size=world, run_id=run, config="c0ffee")
    for step in range(steps):
        log.begin_step(step)
        log.record("admit", pages=[step, step + 1])
        log.end_step(step)
    log.close()


def test_mixed_runs_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(tmp_path, 0, 5, "run-a")
    write_log(tmp_path, 1, 5, "run-b")
    assert main(["check-consensus", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "come from different runs" in err
    assert "run run-a" in err and "run run-b" in err and "diverged" not in err


def test_truncated_log_is_a_stopped_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_log(tmp_path, 0, 8, "r")
    write_log(tmp_path, 1, 8, "r")
    path = tmp_path / "rank-1.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:9]) + lines[9][:7])  # header + 4 steps, then half a line
    assert main(["check-consensus", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "rank 1's log ends at step 3 (rank stopped?)" in out and "diverged" not in out


def test_undecodable_log_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(tmp_path, 0, 3, "r")
    write_log(tmp_path, 1, 3, "r")
    with (tmp_path / "rank-1.jsonl").open("ab") as f:
        f.write(b'{"s": 3, "k": "\xbd"}\n')
    assert main(["check-consensus", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rank-1.jsonl:8 is not UTF-8" in err


def _raise_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise ValueError("a bug in rank code")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for rank 1, which is gone: it only loses its peer
    return 0


def test_a_rank_that_raises_keeps_its_traceback_others_one_line() -> None:
    from kvstrata.ranks.config import DistConfig
    from kvstrata.ranks.group import RankFailure, run_ranks

    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_1, DistConfig(tp=2, backend="gloo", timeout_s=10.0), timeout_s=60)
    lines = str(info.value).splitlines()
    assert lines[0] == "rank 1 failed: ValueError: a bug in rank code", lines
    assert len(lines) <= 2 and all(ln.startswith("rank 0 ") for ln in lines[1:]), lines
    assert set(info.value.traces) == {1} and "Traceback" in info.value.traces[1]

"""The SGLang HiCache integration, each part in its own process (sglang patches transformers on
import; that must not reach the other test files of this pytest worker).

tests/sglang_contract.py holds the contract tests against the real sglang package; the bench
`kvstrata bench sglang --quick` runs beside them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PATH = ROOT / ".venv" / "sglang-extra"  # scripts/setup_sglang.sh installs sglang there


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    assert (SGLANG_PATH / "sglang").is_dir(), (
        f"{SGLANG_PATH} lacks sglang: bash scripts/setup_sglang.sh"
    )
    return subprocess.run(
        [sys.executable, "-W", "ignore", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, "PYTHONPATH": f"{SGLANG_PATH}{os.pathsep}{ROOT}"},
    )


@pytest.mark.slow
def test_contract_against_real_sglang() -> None:
    proc = _run(["-m", "pytest", "-p", "no:cacheprovider", "tests/sglang_contract.py"], 500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "15 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_quick_bench_against_sglang_file(tmp_path: Path) -> None:
    out = tmp_path / "sglang.json"
    args = ["-m", "kvstrata.cli.main", "bench", "sglang", "--quick", "--json", str(out)]
    proc = _run(args, 400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("backup_ratio", "prefetch_ratio", "ours_backup_gbps", "sglang_file_backup_gbps"):
        assert report[key] > 0, (key, report[key])


def test_sglang_not_imported_below_integrations() -> None:
    """Only integrations/ (and the bench on top) may name sglang."""
    pkg = ROOT / "kvstrata"
    for path in pkg.rglob("*.py"):
        if "integrations" in path.parts or path.parent.name == "bench":
            continue
        assert "sglang" not in path.read_text(), f"{path} mentions sglang"

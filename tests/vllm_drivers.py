"""Run a test driver script under vLLM's own Python (.venv-vllm, which scripts/setup_vllm.sh makes)
and read the JSON objects it prints, one per line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from kvstrata.bench.vllm_server import VLLM_BIN

DRIVER_TIMEOUT_S = 300


def run_driver(driver: Path, *args: str) -> list[Any]:
    """`driver ARGS` under vLLM's Python from the repository root; its stdout's JSON lines."""
    python = VLLM_BIN.parent / "python"
    assert python.exists(), f"{python} missing: run scripts/setup_vllm.sh (scripts/test.sh does)"
    run = subprocess.run(
        [str(python), str(driver), *args],
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_S,
        cwd=driver.parent.parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]

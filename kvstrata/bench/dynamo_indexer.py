"""Dynamo's standalone KV indexer (`python -m dynamo.indexer` from ai-dynamo-runtime, installed in
its own venv `.venv-dynamo` by scripts/setup_dynamo.sh) as a local process: the indexer arm of
`kvstrata bench fleet`. The router registers the replicas with it through its HTTP API."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx2 as httpx

from kvstrata.local_ports import free_port
from kvstrata.serve.process import ROOT

DYNAMO_PY = ROOT / ".venv-dynamo" / "bin" / "python"
DYNAMO_FAILED = ROOT / ".venv-dynamo" / ".kvstrata-dynamo-failed"


def dynamo_missing() -> str:
    """Why the indexer cannot run here ('' when it can)."""
    if DYNAMO_FAILED.exists():
        return DYNAMO_FAILED.read_text().strip()
    if not DYNAMO_PY.exists():
        return "no .venv-dynamo (scripts/setup_dynamo.sh makes it)"
    return ""


class DynamoIndexerProcess:
    """One indexer on a free 127.0.0.1 port; `url` once `start()` returned."""

    def __init__(self, log: Path) -> None:
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> DynamoIndexerProcess:
        """Run it and wait until GET /workers answers 200 (RuntimeError with its log's tail)."""
        cmd = [str(DYNAMO_PY), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace")[-1500:]
                raise RuntimeError(f"dynamo indexer did not answer {self.url}/workers: {tail}")
            time.sleep(0.2)
        return self

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/workers", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

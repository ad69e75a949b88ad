"""A real `kvstrata serve` subprocess on 127.0.0.1 and a free port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parents[1]
TINY_ENGINE = [
    "--page-size", "8", "--chunk-tokens", "64", "--max-batch-tokens", "256", "--threads", "1",
]  # fmt: skip
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`kvstrata serve ARGS` as a child process; `url` once /health answers 200."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--port", str(self.port)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.out = log.open("w")
        self.proc = subprocess.Popen(
            [*cmd, *args], cwd=ROOT, env=env, stdout=self.out, stderr=subprocess.STDOUT
        )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy within {START_TIMEOUT_S} s: {self.log.read_text()}")

    def integrity(self) -> dict:
        r = httpx.get(f"{self.url}/debug/integrity", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Integrity report once no request runs or waits (every wait bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            rep = self.integrity()
            if rep["running"] == rep["waiting"] == rep["pending_ops"] == 0 and not rep["owned"]:
                return rep
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not idle within {timeout_s} s: {rep}")
            time.sleep(0.05)

    def terminate(self, timeout_s: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.out.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.out.close()

"""`kvstrata serve` as a child process on 127.0.0.1 (benchmarks and tests start it this way)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx

from kvstrata.local_ports import (
    PortTaken,
    free_port,
    listening_inodes,
    listens,
    with_descendants,
)

START_TRIES = 3  # a port we picked that a neighbour took first is picked again

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`kvstrata serve ARGS` on a free port; returns once `ready_path` (/health) answers 200."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        start_timeout_s: float = 180.0,
        ready_path: str = "/health",
        launcher: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        """port: the one to listen on (None or 0: a free one; a caller picks it to hand the URL
        to another process started at the same time; a restarted server may take its
        predecessor's)."""
        self.ready_path = ready_path
        self.log = log
        # launcher: what runs `-m kvstrata.cli.main` (default this Python; or torchrun's)
        self._head = launcher or [sys.executable]
        self._parent_watch = launcher is None  # our direct child stops by itself if we die
        self._args = args
        for attempt in range(1, START_TRIES + 1):
            self._launch(port or free_port())
            try:
                self._wait_healthy(start_timeout_s)
                return
            except PortTaken:
                self.stop()
                if port or attempt == START_TRIES:
                    raise

    def _launch(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        cmd = [*self._head, "-m", "kvstrata.cli.main", "serve", "--port", str(port)]
        if self._parent_watch:
            cmd += ["--parent-pid", str(os.getpid())]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.out = self.log.open("w")
        # its own process group: stop() also kills what a launcher (torchrun) started, which a
        # SIGKILL of the launcher alone would leave running
        self.proc = subprocess.Popen(
            [*cmd, *self._args],
            cwd=ROOT,
            env=env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _wait_healthy(self, timeout_s: float) -> None:
        """Until /health answers 200 from the server's process or one below it (PortTaken when a
        neighbour holds the port)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._raise_exited()
            try:
                url = f"{self.url}{self.ready_path}"
                if listens(self.port, self.proc.pid, tree=True) and (
                    httpx.get(url, timeout=2).status_code == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy within {timeout_s} s: {self.log.read_text()}")

    def _raise_exited(self) -> None:
        """The server exited before it was healthy: PortTaken when another process listens on
        its port (a neighbour bound it between our look and the server's bind, so the server
        failed to bind; ours is gone, so any listener there is not ours), else RuntimeError."""
        if listening_inodes(self.port):
            raise PortTaken(f"port {self.port} is held by another process; the server exited")
        raise RuntimeError(f"server exited {self.proc.returncode}: {self.log.read_text()}")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit code (TimeoutError when it does not stop in time)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"server did not exit within {timeout_s} s of SIGTERM") from None
        finally:
            self.out.close()

    def end(self, timeout_s: float) -> int:
        """Stop it for good: its exit code after SIGTERM, or -9 when it had to be killed after
        timeout_s (a server already gone: its code, its log closed)."""
        if self.proc.poll() is not None:
            self.stop()
            return int(self.proc.returncode)
        try:
            return self.terminate(timeout_s)
        except TimeoutError:
            self.stop()
            return -9

    def stop(self) -> None:
        """Kill the server, every process of its group and every process below it: torchrun
        starts its ranks in sessions of their own, which a SIGKILL of the group misses and
        torchrun, killed, cannot stop (they would run on, holding memory, CPU and ports)."""
        below = with_descendants(self.proc.pid) if self.proc.poll() is None else []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group is gone already
            pass
        for pid in below[1:]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # went with the group
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self.out.close()

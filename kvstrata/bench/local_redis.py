"""A local redis-server (tests and `kvstrata bench storage` start their own): 127.0.0.1, a free
port, a temp dir, no persistence.

`RedisServer.start()` launches `redis-server --bind 127.0.0.1 --port P --save "" --appendonly no`
and waits until it holds the port and answers PING (a port a neighbour took between pick and bind
is picked again, see kvstrata.local_ports); `kill()` SIGKILLs it (a crash, not a clean shutdown);
`restart()` starts it again on the same port. A missing binary is a RuntimeError with a clear
message (tests turn it into a failure, never a skip: scripts/test.sh installs redis-server).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvstrata.local_ports import KeptPorts, PortTaken, free_port, wait_listening

START_TRIES = 3  # fresh ports per try, for a port it chose itself and never served

REDIS_SERVER_CANDIDATES = ("redis-server", "/usr/bin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> str:
    """Path of the redis-server binary, or RuntimeError saying how to get one."""
    for cand in REDIS_SERVER_CANDIDATES:
        found = shutil.which(cand)
        if found:
            return found
    raise RuntimeError(
        "redis-server binary not found (looked for: " + ", ".join(REDIS_SERVER_CANDIDATES) + "); "
        "install it (Debian/Ubuntu: apt-get install redis-server) — the redis storage tests need a real server"
    )


def ping(port: int, timeout: float = 0.2) -> bool:
    """True if a redis server on 127.0.0.1:port answers PING with +PONG."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process owned by a test (start / kill / restart / stop)."""

    def __init__(self, port: int | None = None) -> None:
        self.binary = find_redis_server()
        self.port = port or free_port()
        self._may_repick = port is None  # a port given, or once served, is the server's URL
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstrata-redis-")
        self.dir = Path(self._tmp.name)
        self.proc: subprocess.Popen[bytes] | None = None
        self._kept = KeptPorts()  # its port while a server that served is killed

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        for attempt in range(1, START_TRIES + 1):
            try:
                self._start_once(timeout)
                self._may_repick = False
                self._kept.release()
                return self
            except (PortTaken, RuntimeError) as e:
                output = self._output()  # before kill(), which closes its stderr
                self.kill()
                if not self._may_repick or attempt == START_TRIES:
                    raise RuntimeError(f"redis-server did not start: {e}{output}") from e
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> None:
        assert self.proc is None or self.proc.poll() is not None, "redis-server already running"
        args = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port)]
        args += ["--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.dir), "--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.dir
        )
        deadline = time.monotonic() + timeout
        wait_listening(self.proc, [self.port], timeout, "redis-server")
        while not ping(self.port):  # it listens before it has loaded
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.02)

    def _output(self) -> str:
        """What a failed start printed: stderr (once it exited) and the log's tail."""
        err = ""
        if self.proc is not None and self.proc.poll() is not None and self.proc.stderr:
            err = self.proc.stderr.read().decode(errors="replace")
        log = self.dir / "redis.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        return f"\n{err}{tail}" if err or tail else ""

    def kill(self) -> None:
        """SIGKILL the server (like a crash) and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            if not self._may_repick:
                self._kept.keep([self.port])
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()

    def restart(self, timeout: float = 10.0) -> RedisServer:
        self.kill()
        return self.start(timeout)

    def stop(self) -> None:
        self.kill()
        self._kept.release()
        self.proc = None
        self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

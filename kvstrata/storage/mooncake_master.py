"""A local `mooncake_master` process (tests and `kvstrata bench storage` start their own).

`MooncakeMaster().start()` runs the master with its HTTP metadata server on 127.0.0.1, on free
ports, and waits until both ports accept connections; `kill()` SIGKILLs it (a crash);
`restart()` starts it again on the same ports; `url(...)` is the `mooncake://` storage URL for
it. `MooncakeHolder` is a standalone `mooncake_client` process contributing a segment (a node's
long-lived memory), so objects outlive the processes that wrote them. The binary comes with the `mooncake-transfer-engine-non-cuda` wheel (the `mooncake` extra,
installed by scripts/setup_env.sh): it is looked up next to this Python, then on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def find_mooncake_master() -> str:
    """Path of the mooncake_master binary, or RuntimeError saying how to get one."""
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("mooncake_master")
    if not found:
        raise RuntimeError(
            "mooncake_master not found (looked beside this Python and on PATH); install the "
            "mooncake extra: bash scripts/setup_env.sh (pip mooncake-transfer-engine-non-cuda)"
        )
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One mooncake_master process with its HTTP metadata server (start / kill / restart / stop)."""

    def __init__(self, client_ttl_s: int = 10) -> None:
        self.binary = find_mooncake_master()
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.client_ttl_s = client_ttl_s
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstrata-mooncake-")
        self.log = Path(self._tmp.name) / "master.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def url(self, segment: str = "64m", buffer: str = "32m", **options: str) -> str:
        """The storage URL of this master (extra query options appended as given)."""
        query = f"metadata={self.metadata}&segment={segment}&buffer={buffer}"
        query += "".join(f"&{k}={v}" for k, v in options.items())
        return f"mooncake://127.0.0.1:{self.rpc_port}?{query}"

    def start(self, timeout: float = 20.0) -> MooncakeMaster:
        assert self.proc is None or self.proc.poll() is not None, "mooncake_master already running"
        args = [
            self.binary,
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--rpc_thread_num=2",  # the machine is small; the default takes 16
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={self.metrics_port}",
            "--enable_metric_reporting=false",
            f"--client_ttl={self.client_ttl_s}",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not (port_open(self.rpc_port) and port_open(self.http_port)):
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {tail}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"mooncake_master did not open ports {self.rpc_port} (rpc) and "
                    f"{self.http_port} (metadata) within {timeout}s"
                )
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        """SIGKILL the master (like a crash) and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self, timeout: float = 20.0) -> MooncakeMaster:
        self.kill()
        return self.start(timeout)

    def stop(self) -> None:
        self.kill()
        self.proc = None
        self._tmp.cleanup()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MooncakeHolder:
    """A standalone mooncake_client process that contributes `segment` bytes to a master."""

    def __init__(self, master: MooncakeMaster, segment: str = "64MB") -> None:
        self.binary = str(Path(master.binary).with_name("mooncake_client"))
        self.master, self.segment, self.port = master, segment, free_port()
        self.log = master.log.with_name(f"holder-{self.port}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> MooncakeHolder:
        args = [
            self.binary,
            f"--global_segment_size={self.segment}",
            f"--master_server_address=127.0.0.1:{self.master.rpc_port}",
            f"--metadata_server={self.master.metadata}",
            "--host=127.0.0.1",
            f"--port={self.port}",
            "--protocol=tcp",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not port_open(self.port):  # its service opens once the segment is mounted
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"mooncake_client did not start within {timeout}s: {tail}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

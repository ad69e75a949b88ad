"""A local `mooncake_master` process (tests and `kvstrata bench storage` start their own).

`MooncakeMaster().start()` runs the master with its HTTP metadata server on 127.0.0.1, on free
ports, and waits until it holds both (not merely until they answer: a neighbour may have taken
one; see kvstrata.local_ports); `kill()` SIGKILLs it (a crash);
`restart()` starts it again on the same ports; `url(...)` is the `mooncake://` storage URL for
it. `MooncakeHolder` is a standalone `mooncake_client` process contributing a segment (a node's
long-lived memory), so objects outlive the processes that wrote them. The binary comes with
the `mooncake-transfer-engine-non-cuda` wheel (the `mooncake` extra, installed by
scripts/setup_env.sh): it is looked up next to this Python, then on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvstrata.local_ports import KeptPorts, PortTaken, free_port, wait_listening

START_TRIES = 3  # fresh ports per try: a neighbour may take a port between pick and bind


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


class MooncakeMaster:
    """One mooncake_master process with its HTTP metadata server (start / kill / restart / stop)."""

    def __init__(self, client_ttl_s: int = 10) -> None:
        self.binary = find_mooncake_master()
        self._pick_ports()
        self._served = False  # once it ran, its ports are its URL: never picked again
        self.client_ttl_s = client_ttl_s
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstrata-mooncake-")
        self.log = Path(self._tmp.name) / "master.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._kept = KeptPorts()  # its ports while it is killed, once it served

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def url(self, segment: str = "64m", buffer: str = "32m", **options: str) -> str:
        """The storage URL of this master (extra query options appended as given)."""
        query = f"metadata={self.metadata}&segment={segment}&buffer={buffer}"
        query += "".join(f"&{k}={v}" for k, v in options.items())
        return f"mooncake://127.0.0.1:{self.rpc_port}?{query}"

    def _pick_ports(self) -> None:
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()

    def start(self, timeout: float = 20.0) -> MooncakeMaster:
        """Run the master and wait until it, not a neighbour, listens on both ports. Ports it
        never served are picked afresh (up to START_TRIES times) when another process took one
        first; a restart keeps its ports (clients hold the URL) and fails naming the port."""
        for attempt in range(1, START_TRIES + 1):
            try:
                self._start_once(timeout)
                self._served = True
                self._kept.release()
                return self
            except (PortTaken, RuntimeError) as e:
                self.kill()
                if self._served or attempt == START_TRIES:
                    tail = self.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"mooncake_master did not start: {e}\n{tail}") from e
                self._pick_ports()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> None:
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
        wait_listening(self.proc, [self.rpc_port, self.http_port], timeout, "mooncake_master")

    def kill(self) -> None:
        """SIGKILL the master (like a crash) and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            if self._served:
                self._kept.keep([self.rpc_port, self.http_port, self.metrics_port])

    def restart(self, timeout: float = 20.0) -> MooncakeMaster:
        self.kill()
        return self.start(timeout)

    def stop(self) -> None:
        self.kill()
        self._kept.release()
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
        self.log = master.log.with_name(f"holder-{self.port}.log")  # named by its first port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> MooncakeHolder:
        """Run the holder; its service port opens once the segment is mounted (a port a
        neighbour took first is picked again, up to START_TRIES times)."""
        for attempt in range(1, START_TRIES + 1):
            try:
                self._start_once(timeout)
                return self
            except (PortTaken, RuntimeError) as e:
                self.stop()
                if attempt == START_TRIES:
                    tail = self.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"mooncake_client did not start: {e}\n{tail}") from e
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> None:
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
        wait_listening(self.proc, [self.port], timeout, "mooncake_client")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

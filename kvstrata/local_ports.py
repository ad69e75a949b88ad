"""Local TCP ports for the processes kvstrata starts (servers, stores, ranks, benchmarks).

`free_port()` asks the OS for a port that was free a moment ago. Nothing reserves it: another
process (a test running beside ours, a second server started at the same time) may bind it
before the process we start does. Then "the port accepts connections" proves nothing: the
connection may reach the neighbour, and the process we started fails to bind a moment later.
So a launcher waits with `wait_listening`, which asks the kernel which process holds the
listening socket (`/proc/net/tcp*` inodes matched against `/proc/PID/fd`), and raises
`PortTaken` when it is not ours, so the caller can pick fresh ports and start again.

Where /proc is not there (not Linux) ownership cannot be read, and an open port counts as ours.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

LISTEN_STATE = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
POLL_S = 0.05


class PortTaken(RuntimeError):
    """A port we chose is held by a process that is not the one we started."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; nothing reserves it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port held bound but not listening while the block runs: connections to it are refused,
    and no server started meanwhile can take it (a port `free_port` found free once can be: a
    client told "nothing listens there" may then reach a neighbour's server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        yield int(s.getsockname()[1])


def hold_port(port: int = 0, host: str = "127.0.0.1") -> socket.socket | None:
    """A socket bound to `port` (0: one the OS picks) with SO_REUSEADDR, not listening; None
    when it cannot be bound. While it is open `free_port` in any process never returns that
    port (the kernel hands out only unused ones) and a bind without SO_REUSEADDR fails, but a
    server binding with SO_REUSEADDR (uvicorn, redis, libzmq, asio, libuv: torch's TCPStore)
    still can, and connections to it are refused until one listens. So it keeps a port for a
    process we start, or for a server we killed and restart on the same port (clients hold its
    URL). It narrows the race `free_port` leaves but does not close it: a port a neighbour
    picked before we held it can still be bound by that neighbour."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


class KeptPorts:
    """The ports of a local server that served, held (hold_port) while it is down: a neighbour
    taking one meanwhile would answer our clients (who hold its URL) and block the restart on
    the same ports."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []

    def keep(self, ports: Sequence[int]) -> None:
        """Hold those of `ports` still free (nothing more while some are held)."""
        if not self._held:
            self._held = [h for h in map(hold_port, ports) if h is not None]

    def release(self) -> None:
        """Let them go: the server binds them again, or it stopped for good."""
        for held in self._held:
            held.close()
        self._held = []


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port held (see hold_port) while the block runs, for a process we start to bind."""
    held = hold_port(0, host)
    assert held is not None  # port 0: the OS always finds one
    with held:
        yield int(held.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    """True if something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def listening_inodes(port: int) -> set[int] | None:
    """Socket inodes listening on `port` (IPv4 and IPv6); None where /proc/net/tcp is absent."""
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        return None
    inodes: set[int] = set()
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            fields = line.split()
            if fields[3] == LISTEN_STATE and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def _socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds (empty when its fds cannot be read)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    found: set[int] = set()
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return found
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def with_descendants(root: int) -> list[int]:
    """`root` and every process below it (a launcher's workers may sit in sessions of their
    own, as torchrun's do, so the process group would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, ppid, ...
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def holders(port: int) -> str:
    """Who listens on `port`, for a message: "pid 12 (redis-server), pid 34 (...)" (every
    process's fds are read: for errors only)."""
    inodes = listening_inodes(port) or set()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _socket_inodes(int(entry.name)) & inodes:
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:  # exited while we looked
                continue
            found.append(f"pid {entry.name} ({name})")
    return ", ".join(found) or "no process we can see"


def _inodes_of(pid: int, tree: bool) -> set[int]:
    pids = with_descendants(pid) if tree else [pid]
    return set().union(*(_socket_inodes(p) for p in pids))


def held_by(port: int, pid: int, tree: bool = False) -> bool | None:
    """Whether process `pid` (with `tree`: it or any process below it) listens on `port`; None
    where the kernel tables cannot be read."""
    inodes = listening_inodes(port)
    if inodes is None:
        return None
    return bool(_inodes_of(pid, tree) & inodes)


def listens(port: int, pid: int, tree: bool = False) -> bool:
    """True once `pid` (with `tree`: it or a process below it) alone listens on `port`; raises
    PortTaken when another process does, beside it or instead of it. Beside it: servers that
    bind with SO_REUSEPORT (mooncake_master does) share a port, and the kernel then hands each
    new connection to either of them, so a client of ours may be served by the neighbour."""
    inodes = listening_inodes(port)
    if inodes is None:  # ownership unreadable here: an open port is all we can know
        return port_open(port)
    if not inodes:
        return False  # nothing listens yet
    mine = _inodes_of(pid, tree) & inodes
    if mine == inodes:
        return True
    if mine:
        raise PortTaken(
            f"port {port} is held by another process too (SO_REUSEPORT), beside pid {pid}: "
            f"{holders(port)}"
        )
    again = listening_inodes(port) or set()  # ours may have bound between the two looks
    if again and again <= _inodes_of(pid, tree):
        return True
    raise PortTaken(f"port {port} is held by another process, not by pid {pid}: {holders(port)}")


def wait_listening(
    proc: subprocess.Popen[bytes], ports: Sequence[int], timeout: float, what: str
) -> None:
    """Until `proc` itself listens on every port. PortTaken when another process holds one;
    RuntimeError when `proc` exits first or `timeout` passes (the message names `what`)."""
    deadline = time.monotonic() + timeout
    pending = list(ports)
    while pending:
        pending = [p for p in pending if not listens(p, proc.pid)]
        if not pending:
            return
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {proc.returncode} before listening on port(s) {pending}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen on port(s) {pending} within {timeout}s")
        time.sleep(POLL_S)

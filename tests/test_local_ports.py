"""A port a neighbour took between our pick and our server's bind: the launcher notices that the
listener is not the process it started (it does not trust "the port answers"), picks fresh ports
where the port was its own choice, and names the port where it was not."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.bench.local_mooncake import MooncakeMaster
from kvstrata.bench.local_redis import RedisServer, ping
from kvstrata.local_ports import (
    PortTaken,
    held_by,
    listens,
    port_open,
    refused_port,
    reserved_port,
)
from tests.pd_helpers import complete, start_all, worker_args

CKPT = {"seed": 4, "max_position_embeddings": 256}

LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket()\n"
    "if sys.argv[1] == 'reuseport':\n"
    "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
    "s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True); time.sleep(600)\n"
)


@pytest.fixture
def neighbour(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Another process (its own session) listening on a port; yields it and the port. With
    SO_REUSEPORT (as mooncake_master binds) a server of ours can bind the port beside it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER, getattr(request, "param", "plain")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    yield proc, port
    proc.kill()
    proc.wait(10)


def test_the_kernel_names_who_listens(neighbour: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = neighbour
    assert held_by(port, proc.pid) is True
    assert held_by(port, proc.pid, tree=True) is True
    assert held_by(port, 1) is False
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen()
        own = mine.getsockname()[1]
        assert held_by(own, os.getpid()) is True and listens(own, os.getpid())
        assert held_by(own, proc.pid) is False
    with pytest.raises(PortTaken, match=f"port {port} is held by another process"):
        listens(port, proc.pid + 10_000_000)  # no such pid: the port is not its


def test_a_port_shared_through_so_reuseport_is_not_ours() -> None:
    """The kernel would hand each new connection to either listener: ours may never see a
    client's calls, and a stopped server of ours may seem to answer."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER, "reuseport"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.socket() as mine:
            mine.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            mine.bind(("127.0.0.1", port))
            mine.listen()
            assert held_by(port, os.getpid()) is True and held_by(port, proc.pid) is True
            with pytest.raises(PortTaken, match=f"port {port} is held by another process too"):
                listens(port, os.getpid())
        assert listens(port, proc.pid)  # alone again
    finally:
        proc.kill()
        proc.wait(10)


def test_redis_picks_a_fresh_port_when_its_own_pick_was_taken(
    neighbour: tuple[subprocess.Popen[str], int],
) -> None:
    _, port = neighbour
    server = RedisServer()
    server.port = port  # as if a neighbour had bound our pick first
    try:
        server.start()
        assert server.port != port and ping(server.port)
        assert held_by(server.port, server.proc.pid) is True  # type: ignore[union-attr]
    finally:
        server.stop()


def test_redis_on_a_given_port_names_it(neighbour: tuple[subprocess.Popen[str], int]) -> None:
    _, port = neighbour
    server = RedisServer(port=port)
    try:
        with pytest.raises(RuntimeError, match=f"port {port} is held by another process"):
            server.start()
        assert server.port == port
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("neighbour", ["plain", "reuseport"], indirect=True)
def test_mooncake_master_repicks_then_keeps_its_ports(
    neighbour: tuple[subprocess.Popen[str], int],
) -> None:
    _, port = neighbour
    master = MooncakeMaster()
    master.rpc_port = port  # taken before the master could bind it
    try:
        master.start()
        served = master.rpc_port
        assert served != port
        assert master.proc is not None and held_by(served, master.proc.pid) is True
        master.kill()
        master.rpc_port = port  # a restart keeps its URL's ports: it fails and names the port
        with pytest.raises(RuntimeError, match=f"port {port} is held by another process"):
            master.start()
    finally:
        master.stop()


def test_a_refused_port_refuses_and_a_reserved_one_is_kept_for_a_reuseaddr_server() -> None:
    with refused_port() as port:
        assert not port_open(port)
    with reserved_port() as port:
        with socket.socket() as plain, pytest.raises(OSError):  # what free_port() asks for
            plain.bind(("127.0.0.1", port))
        with socket.socket() as server:  # as uvicorn, libzmq and torch's TCPStore bind
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            assert held_by(port, os.getpid()) is True


@pytest.mark.slow
def test_pd_workers_started_together_move_off_a_taken_port(
    ckpt: Path, tmp_path: Path, neighbour: tuple[subprocess.Popen[str], int]
) -> None:
    """The prefill port given (picked first, listed by decode) was bound by a neighbour: both
    workers start again on a fresh pick, and decode lists the prefill worker's new port."""
    _, taken = neighbour
    decode = worker_args(ckpt, "--role", "decode", "--pd-prefill", f"http://127.0.0.1:{taken}")
    specs = [(worker_args(ckpt, "--role", "prefill"), tmp_path / "p.log", taken)]
    p, d = start_all([*specs, (decode, tmp_path / "d.log")])
    try:
        assert p.port != taken and held_by(p.port, p.proc.pid, tree=True) is True
        r = complete(d, [5, 6, 7, 8, 9, 10, 11, 12, 13], pd_prefill=p.url)  # one it lists
        assert r.status_code == 200, r.text
        assert (
            r.json()["choices"][0]["text"]
            == complete(p, [5, 6, 7, 8, 9, 10, 11, 12, 13]).json()["choices"][0]["text"]
        )
    finally:
        for s in (p, d):
            s.stop()

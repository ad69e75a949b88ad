"""A real `kvstrata serve` subprocess for the server tests, with its debug integrity report."""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Callable, Iterator

import httpx2 as httpx
import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstrata.cache.event_wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvstrata.local_ports import free_port, refused_port, reserved_port
from kvstrata.serve.process import ServerProcess

TINY_ENGINE = [
    "--page-size", "8", "--chunk-tokens", "64", "--max-batch-tokens", "256", "--threads", "1",
]  # fmt: skip
__all__ = [
    "TINY_ENGINE", "Server", "alive", "apply_events", "free_port", "metrics_when", "refused_port",
    "raw_http", "read_reply", "reserved_ports", "subscribed", "trickle",
]  # fmt: skip


class Server(ServerProcess):
    """The server process plus /debug/integrity (start it with --debug-endpoints)."""

    def integrity(self) -> dict:
        r = httpx.get(f"{self.url}/debug/integrity", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Integrity report once no request runs, waits or holds pages and no cache op is
        pending."""
        deadline = time.monotonic() + timeout_s
        while True:
            rep = self.integrity()
            quiet = rep["running"] == rep["waiting"] == rep["held"] == rep["pending_ops"] == 0
            if quiet and not rep["owned"]:
                return rep
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not idle within {timeout_s} s: {rep}")
            time.sleep(0.05)


def apply_events(batch: bytes, held: dict[str, set[int]], page: int = 8) -> None:
    """Apply one KV event batch (either wire format) to per-medium block sets, checking its
    shape."""
    assert isinstance(msgpack.unpackb(batch)[0], float)
    decoded = decode_batch(batch)
    assert decoded.data_parallel_rank == 0
    for ev in decoded.events:
        if isinstance(ev, BlockStored):
            assert ev.block_size == page and ev.lora_name is None
            assert ev.parent_block_hash is None or isinstance(ev.parent_block_hash, int)
            assert len(ev.token_ids) in (0, page * len(ev.block_hashes))
            held[ev.medium].update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            assert set(ev.block_hashes) <= held[ev.medium]  # only what was stored is removed
            held[ev.medium].difference_update(ev.block_hashes)
        else:
            assert isinstance(ev, AllBlocksCleared)
            for s in held.values():
                s.clear()


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def subscribed(sock: zmq.Socket, endpoint: str, timeout_s: float = 30.0) -> None:
    """Connect `sock` (a SUB, its subscriptions set) to `endpoint` and return once the handshake
    with the publisher is done, so the subscription is on its way before the first event (a
    fixed sleep for it can be too short on a loaded machine, and then events go missing)."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # before connect: no event lost
    try:
        sock.connect(endpoint)
        if not mon.poll(int(timeout_s * 1000)):
            raise TimeoutError(
                f"no handshake with the publisher at {endpoint} within {timeout_s} s"
            )
        recv_monitor_message(mon)
    finally:
        sock.disable_monitor()
        mon.close()


def metrics_when(url: str, ready: Callable[[str], bool], what: str, timeout_s: float = 30.0) -> str:
    """/metrics text once `ready(text)`: with ranks, rank 0 reports its counters to the HTTP
    process every 0.5 s, so they lag the last step (a fixed sleep can be too short under load)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        if ready(text):
            return text
        if time.monotonic() > deadline:
            raise TimeoutError(f"/metrics of {url} did not show {what} within {timeout_s} s")
        time.sleep(0.1)


@contextlib.contextmanager
def reserved_ports(n: int) -> Iterator[tuple[int, ...]]:
    """`n` ports held for the block (see local_ports.reserved_port): for the ports a test hands
    a server in its arguments (KV event endpoints), which no other process's free_port() picks
    while the server starts and binds them (libzmq binds with SO_REUSEADDR)."""
    with contextlib.ExitStack() as held:
        yield tuple(held.enter_context(reserved_port()) for _ in range(n))


def raw_http(port: int, head: str, body: bytes = b"") -> str:
    """Send `head` + `body` on a fresh socket; the whole reply (head and body) as text."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        return read_reply(sock)


def read_reply(sock: socket.socket) -> str:
    """One HTTP reply from `sock`, or what came before the server closed it."""
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _length(reply):
        got = sock.recv(1 << 16)  # the head and body may come in separate segments
        if not got:
            break
        reply += got
    return reply.decode(errors="replace")


def _length(reply: bytes) -> int:
    """The Content-Length of a reply's head (0 when it has none)."""
    m = re.search(rb"(?im)^content-length: *(\d+)", reply)
    return int(m.group(1)) if m else 0


def trickle(sock: socket.socket, data: bytes, limit_s: float) -> tuple[str, float]:
    """Send `data` one byte a second (a slowloris client) until the server closes `sock` or
    `limit_s` passes; (what the server answered, seconds it took to close)."""
    t0 = time.monotonic()
    sock.settimeout(1.0)
    reply = b""
    for byte in data:
        if time.monotonic() - t0 > limit_s:
            break
        try:
            sock.sendall(bytes([byte]))
            got = sock.recv(1 << 16)  # waits up to 1 s: the pace of the trickle
        except TimeoutError:
            continue
        except OSError:  # reset: the server closed while we wrote
            break
        reply += got
        if not got:
            break
    return reply.decode(errors="replace"), time.monotonic() - t0

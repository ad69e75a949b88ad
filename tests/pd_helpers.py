"""P/D test helpers: prefill and decode workers as real `kvstrata serve` processes, started in
parallel, and a raw decode-side client of a prefill worker's transfer endpoint."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np

from kvstrata.cache.keys import Namespace, page_keys
from kvstrata.local_ports import PortTaken, free_port
from kvstrata.pd.local_keys import local_keys
from kvstrata.pd.transport import TRANSPORTS
from kvstrata.pd.wire import (
    Frames,
    Received,
    assemble,
    header,
    pack_keys,
    pages_message,
    pulled_message,
    read_header,
    read_layer,
    read_pages,
)
from kvstrata.zmq_curve import CurveKeys
from tests.serve_helpers import TINY_ENGINE, Server

PAGE = 8


INSECURE = "--pd-insecure"
"""For modules that corrupt the link itself (CuttableRelay): under CURVE (the default) its MAC
drops a flipped bit before the hand-off's own checksums could see it."""


def worker_args(ckpt: Path, *extra: str, store: Path | None = None) -> list[str]:
    """A tiny-model worker (page size 8) with integrity endpoints, optionally sharing a storage
    dir."""
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "40", "--host-pages", "64"]
    if store is not None:
        args += ["--storage-url", f"file://{store}", "--prefetch-policy", "wait_complete"]
    return [*args, "--debug-endpoints", *extra]


Spec = tuple[list[str], Path] | tuple[list[str], Path, int]
START_TRIES = 3  # ports a neighbour took between our pick and the server's bind are picked again


def start_all(specs: list[Spec]) -> list[Server]:
    """Start every server at once (each waits for its own /health); all or none. A spec's
    third item is the port to listen on, picked first with free_port, so a decode started
    alongside can list that prefill worker in --pd-prefill as `127.0.0.1:PORT`. Nothing
    reserves such a port: when another process holds one (PortTaken), every given port is
    picked again, rewritten in every spec's arguments, and all start again."""
    for attempt in range(1, START_TRIES + 1):
        out = _start_once(specs)
        failed = [x for x in out if not isinstance(x, Server)]
        if not failed:
            return out  # type: ignore[return-value]
        for x in out:
            if isinstance(x, Server):
                x.stop()
        if attempt == START_TRIES or not any(isinstance(x, PortTaken) for x in failed):
            raise RuntimeError(f"a server failed to start: {failed[0]!r}")
        specs = _repicked(specs)
    raise AssertionError("unreachable")


def _start_once(specs: list[Spec]) -> list[Server | BaseException | None]:
    out: list[Server | BaseException | None] = [None] * len(specs)

    def one(i: int) -> None:
        try:
            spec = specs[i]
            out[i] = Server(spec[0], spec[1], port=spec[2] if len(spec) > 2 else 0)  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001 - re-raised by start_all, after the others
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _repicked(specs: list[Spec]) -> list[Spec]:
    """Fresh ports for every spec that gives one; `127.0.0.1:OLD` in any argument follows."""
    moved = {spec[2]: free_port() for spec in specs if len(spec) > 2 and spec[2]}  # type: ignore[misc]

    given = re.compile(r"127\.0\.0\.1:(\d+)(?!\d)")

    def follow(arg: str) -> str:  # one pass: a new port that equals another's old one stays
        return given.sub(lambda m: f"127.0.0.1:{moved.get(int(m[1]), int(m[1]))}", arg)

    return [
        (
            [follow(a) for a in spec[0]],
            spec[1],
            *([moved.get(spec[2], spec[2])] if len(spec) > 2 else []),
        )  # type: ignore[misc]
        for spec in specs
    ]


def info(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/v1/pd/info", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def complete(
    server: Server, prompt: list[int], max_tokens: int = 4, **extra: Any
) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def metrics(server: Server) -> dict[str, float]:
    """Every sample of /metrics, by its name and labels."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def no_pages(head: dict[str, Any]) -> Frames:
    """A `pulled` reply with no page: a raw client holds no KV (prefill computes them)."""
    return pulled_message(head["id"], head["first_page"], [])


def _answer(
    ch: Any, endpoint: str, timeout_s: float, layer_bytes: int, pull: Callable
) -> tuple[dict[str, Any], Frames, dict[int, list], list[list[int]]]:
    """Receive until prefill's answer: (its header, its frames, layers so far, pulls asked);
    each `pull` is answered with `pull(head)` (None: not answered)."""
    layers: dict[int, list] = {}
    pulls: list[list[int]] = []
    while True:
        frames = ch.recv(timeout_s)
        assert frames is not None, f"no reply from {endpoint} within {timeout_s} s"
        head = read_header(frames)
        if head["type"] == "layer":
            layers[head["layer"]] = read_layer(head, frames, layer_bytes)
        elif head["type"] == "pull":
            pulls.append([head["first_page"], head["end_page"]])
            reply = pull(head)
            if reply is not None:
                ch.send(reply)
        elif head["type"] != "heartbeat":
            return head, frames, layers, pulls


def raw_handoff(
    endpoint: str,
    tokens: list[int],
    keys: list[int],
    layout: dict[str, Any],
    salt: str = "",
    hid: str = "raw",
    timeout_s: float = 30.0,
    part: tuple[int, int] | None = None,
    pull: Callable[[dict[str, Any]], Frames | None] = no_pages,
    extra: dict[str, Any] | None = None,
    curve: CurveKeys | None = None,
    insecure: bool = False,
) -> tuple[dict[str, Any], Frames]:
    """Ask a prefill worker for a hand-off as decode would: its answer (a refusal, or the pages
    with the logits row; pages sent layer by layer are put together and re-framed as one
    `pages` message, whose header counts them in "layer_messages"). part: (layers, page bytes)
    of the rank asked, when the worker runs on several ranks (else the whole page).
    pull: the reply to each of prefill's `pull` headers (None: stay silent, as a dead decode
    would). The header returned lists the pulls asked: "pulls": [[first_page, end_page], ...].
    extra: more hand-off fields (under cp: "owners"). curve: this client's CURVE keys (the
    worker's own key must be among their peers); default: this user's own pair, which workers
    started without --pd-curve-* use (kvstrata/pd/local_keys.py); insecure: no CURVE (a
    worker started with --pd-insecure)."""
    curve = None if insecure else curve or local_curve()
    n_layers, page_bytes = part or (layout["layers"], layout["page_bytes"])
    ask = dict(tokens=tokens, salt=salt, keys=pack_keys(keys), layout=layout, **(extra or {}))
    transport = TRANSPORTS.create("zmq", **({"curve": curve} if curve else {}))
    ch = transport.connect(endpoint, "", next(iter(curve.peers)) if curve else b"")
    try:
        ch.send([header("handoff", hid, **ask)])
        head, frames, layers, pulls = _answer(ch, endpoint, timeout_s, page_bytes // n_layers, pull)
    finally:
        ch.close()
    if head["type"] == "pages" and head.get("layers"):
        n = len(next(iter(layers.values()), []))
        pages = assemble(layers, n_layers, n)
        row = np.frombuffer(frames[-1], dtype=np.float32)
        frames = pages_message(
            hid, head["first_page"], pages, row, computed_tokens=head["computed_tokens"]
        )
        head = {**read_header(frames), "layer_messages": len(layers)}
    return {**head, "pulls": pulls}, frames


def local_curve() -> CurveKeys:
    """This user's P/D key pair, as a worker started without --pd-curve-* loads it."""
    return CurveKeys.load(*local_keys(), "this user's P/D keys")


def keys_of(layout: dict[str, Any], tokens: list[int]) -> list[int]:
    """Keys of the prompt's first hittable pages, as decode computes them (no salt)."""
    ns = Namespace(layout["model"], layout["dtype"], page_size=layout["page_size"])
    full = (len(tokens) - 1) // PAGE * PAGE
    return page_keys(tokens[:full], ns, 97)


def ranks(server: Server) -> list[dict[str, Any]]:
    """GET /v1/pd/ranks: each rank's part of a page and its own measured counters."""
    r = httpx.get(f"{server.url}/v1/pd/ranks", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["ranks"]


def ranks_parts(pinfo: dict[str, Any]) -> list[tuple[int, int]]:
    """(layers, page bytes) of each rank's part: half the heads (tp) or half the layers (pp)."""
    lay = pinfo["layout"]
    layers = lay["layers"] // lay["pp"]
    return [(layers, lay["page_bytes"] // (lay["tp"] * lay["pp"]))] * 2


def both_ranks(
    pinfo: dict[str, Any],
    prompt: list[int],
    hid: str,
    keys: list[int] | None = None,
    pulls: list[Callable] | None = None,
) -> list[tuple[dict[str, Any], Frames]]:
    """A hand-off asked of both ranks of a prefill worker at once, as decode's two ranks would:
    each rank's (header, frames) (see raw_handoff). keys: what decode holds; pulls: rank r's
    answer to its peer's `pull` (default: no page)."""
    lay, parts = pinfo["layout"], ranks_parts(pinfo)
    got: list[Any] = [None, None]

    def one(r: int) -> None:
        got[r] = raw_handoff(
            pinfo["transfer_endpoints"][r], prompt, keys or [], {**lay, "rank": r},
            hid=hid, part=parts[r], pull=pulls[r] if pulls else no_pages,
        )  # fmt: skip

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def both_parts(pinfo: dict[str, Any], prompt: list[int], hid: str) -> list[Received]:
    """Every page of `prompt` as each rank of a prefill worker computes its part (cold)."""
    parts = ranks_parts(pinfo)
    got = both_ranks(pinfo, prompt, hid)
    return [read_pages(head, frames, parts[r][1]) for r, (head, frames) in enumerate(got)]


class CuttableRelay:
    """A TCP relay 127.0.0.1:port -> target that can drop every connection at once (`cut`):
    a dropped link between two live workers. Connections made after a cut relay again."""

    def __init__(
        self,
        target: str,
        corrupt: int = 0,
        at: int = 1000,
        upward: bool = False,
        stall_after: int = -1,
    ) -> None:
        """`corrupt`: flip one bit at byte `at` of what the target sends on that many of the
        first connections (deep inside the first page frame: the framing stays valid);
        `upward`: of what the client sends the target instead (decode's pulled pages);
        `stall_after`: pass on only that many bytes of what the target sends, then read and
        drop the rest (`withheld` counts it): a transfer cut off part way."""
        self.corrupt, self.at, self.upward = corrupt, at, upward
        self.stall_after, self.withheld = stall_after, 0
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.srv.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.srv.accept()
                up = socket.create_connection(self.target, timeout=5)
            except OSError:
                return
            up.settimeout(None)
            self.accepted += 1
            self.conns += [down, up]
            flip = self.at if self.accepted <= self.corrupt else -1
            flips = (flip, -1) if self.upward else (-1, flip)
            for a, b, f, cap in ((down, up, flips[0], -1), (up, down, flips[1], self.stall_after)):
                threading.Thread(target=self._pipe, args=(a, b, f, cap), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, flip: int = -1, cap: int = -1) -> None:
        seen = 0
        try:
            while data := a.recv(65536):
                if 0 <= flip - seen < len(data):
                    buf = bytearray(data)
                    buf[flip - seen] ^= 0x10
                    data = bytes(buf)
                if cap >= 0 and seen + len(data) > cap:  # past the cap: hold the rest back
                    self.withheld += seen + len(data) - max(seen, cap)
                    data = data[: max(0, cap - seen)]
                seen += len(data)
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.conns = []

    def close(self) -> None:
        self.srv.close()
        self.cut()


@dataclass
class Workers:
    """One test's P/D workers (no test sees another's): a prefill p1 and a decode d sharing the
    storage directory `store`; servers: every process the test started, stopped when it ends."""

    tmp: Path
    store: Path
    p1: Server
    d: Server
    servers: list[Server] = field(default_factory=list)

    def start(self, *specs: tuple[list[str], Path]) -> list[Server]:
        started = start_all(list(specs))
        self.servers += started
        return started


def wait_linked(endpoints: list[str], timeout_s: float = 30.0) -> None:
    """Until a TCP connection to each tcp://HOST:PORT endpoint is established (the kernel's
    table): a hand-off's link to a prefill worker is up even while that worker is SIGSTOPped (the
    kernel accepts for it), so a kill from then on is "connection lost", never "refused". A fixed
    sleep for it can be too short on a loaded machine."""
    ports = {int(e.rsplit(":", 1)[1]) for e in endpoints}
    deadline = time.monotonic() + timeout_s
    while True:
        linked = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()  # sl local rem st ...; 01: ESTABLISHED
                if fields[3] == "01":
                    linked.add(int(fields[2].rsplit(":", 1)[1], 16))
        if ports <= linked:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no connection to {sorted(ports - linked)} within {timeout_s} s")
        time.sleep(0.02)

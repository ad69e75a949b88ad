"""Recovery without a person, with real processes: a prefill worker killed (-9) and restarted on
the same HTTP port (so with a new transfer endpoint) is used again by routers that were never
restarted. A router that probes finds the new endpoint through its /health probe (its own
/health says 503 naming the prefill while it is dead); one that does not probe reads the
worker's /v1/pd/info again when a hand-off fails and tries once more. Answers equal the
single-server ones, and every worker's pools stay intact."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from kvstrata.local_ports import hold_port
from kvstrata.serve.process import ServerProcess
from tests.pd_helpers import complete, info, start_all, worker_args
from tests.serve_helpers import Server, free_port

pytestmark = pytest.mark.slow  # several real server processes

CKPT = {"seed": 2, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""

SILENCE_S = 30.0  # decode's --pd-timeout-s in the dead-prefill test
PROMPTS = [[(5 * i + 1 + k) % 97 for i in range(41)] for k in range(3)]


def prefill_args(ckpt: Path) -> list[str]:
    return worker_args(ckpt, "--role", "prefill", "--pd-heartbeat-s", "0.2")


def router_metric(url: str, name: str, **labels: str) -> float:
    """One sample of the router's /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = ",".join(f'{k}="{re.escape(v)}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^kvstrata:router_{name}_total\{{{want}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_health(url: str, status: int, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{url}/health", timeout=30)
        if r.status_code == status:
            return r.json()
        assert time.monotonic() < deadline, (
            f"router /health not {status} in {timeout_s} s: {r.text}"
        )
        time.sleep(0.1)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture
def servers(ckpt: Path, tmp_path: Path) -> Iterator[list[Server]]:
    """[prefill, decode]; decode's silence bound is far above anything the test waits."""
    port = free_port()  # picked first: decode lists this prefill worker in --pd-prefill
    decode = worker_args(
        ckpt, "--role", "decode", "--pd-timeout-s", "3", "--pd-prefill", f"http://127.0.0.1:{port}"
    )
    specs = [(prefill_args(ckpt), tmp_path / "p.log", port), (decode, tmp_path / "d.log")]
    srvs = start_all(specs)
    yield srvs
    for s in srvs:
        s.stop()


def test_prefill_restarted_on_its_port_is_used_again(
    ckpt: Path, tmp_path: Path, servers: list[Server]
) -> None:
    p, d = servers
    cmd = ["--role", "router", "--prefill", p.url, "--decode", d.url]
    quiet = ServerProcess([*cmd, "--router-health-interval-s", "3600"], tmp_path / "r1.log", 60)
    probing = ServerProcess([*cmd, "--router-health-interval-s", "0.2"], tmp_path / "r2.log", 60)
    try:
        want = [text_of(complete(p, q)) for q in PROMPTS]  # prefill answers as a single server
        assert text_of(complete(quiet, PROMPTS[0])) == want[0]
        old = info(p)["transfer_endpoint"]
        p.stop()  # kill -9
        # its port stays bound (not listening) until p2 binds it (uvicorn: SO_REUSEADDR), so no
        # neighbour's free_port() picks it while p is down (p2 would fail, the router reach it)
        held = hold_port(p.port)
        err = wait_health(probing.url, 503)["error"]["message"]
        assert p.url in err
        p2 = Server(prefill_args(ckpt), tmp_path / "p2.log", port=p.port)
        if held is not None:
            held.close()
        servers.append(p2)
        assert info(p2)["transfer_endpoint"] != old
        wait_health(probing.url, 200)  # its probe read the new endpoint
        assert text_of(complete(probing, PROMPTS[1])) == want[1]
        assert router_metric(probing.url, "handoff_retries", to="same", worker=p.url) == 0
        # the router that does not probe still sends the old endpoint: the hand-off fails,
        # it reads the worker's info again and tries once more, with the new endpoint
        assert text_of(complete(quiet, PROMPTS[2])) == want[2]
        assert router_metric(quiet.url, "handoff_retries", to="same", worker=p.url) == 1
        assert httpx.get(f"{quiet.url}/health", timeout=30).status_code == 200
        for s in (p2, d):
            rep = s.wait_idle()
            assert rep["ok"] and rep["accounting"]["device"]["locked"] == 0
    finally:
        for router in (quiet, probing):
            assert router.terminate() == 0, router.log.read_text()


def in_threads(n: int, fn: Callable[[int], httpx.Response]) -> tuple[list[threading.Thread], dict]:
    """fn(i) for i < n, each in its own thread; answers (or HTTP errors) by i."""
    out: dict[int, httpx.Response | Exception] = {}

    def one(i: int) -> None:
        try:
            out[i] = fn(i)
        except httpx.HTTPError as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, out


def test_requests_queued_behind_a_dead_prefill_fail_fast_or_move(
    ckpt: Path, tmp_path: Path
) -> None:
    """Prefill p1 is frozen, then killed (-9) while 8 requests wait for it: its links drop, so
    decode fails each hand-off within a heartbeat (not after its 30 s silence bound). A router
    with another prefill tries those requests once more there (they succeed); a router with
    only p1 answers each with a 502 naming p1's transfer endpoint. Every answer comes well
    before the first request's silence bound would have run out."""
    ports = [free_port(), free_port()]  # picked first: decode lists both in --pd-prefill
    listed = ",".join(f"http://127.0.0.1:{port}" for port in ports)
    decode = worker_args(
        ckpt, "--role", "decode", "--pd-timeout-s", str(SILENCE_S), "--pd-prefill", listed
    )
    p1, p2, d = start_all(
        [
            (prefill_args(ckpt), tmp_path / "p1.log", ports[0]),
            (prefill_args(ckpt), tmp_path / "p2.log", ports[1]),
            (decode, tmp_path / "d.log"),
        ]
    )
    quiet = ["--router-health-interval-s", "3600"]
    both = ServerProcess(
        ["--role", "router", "--prefill", f"{p1.url},{p2.url}", "--decode", d.url, *quiet],
        tmp_path / "r1.log",
        60,
    )
    only = ServerProcess(
        ["--role", "router", "--prefill", p1.url, "--decode", d.url, *quiet],
        tmp_path / "r2.log",
        60,
    )
    prompts = [[(7 * i + 3 + k) % 97 for i in range(33)] for k in range(8)]
    try:
        want = [text_of(complete(p2, q)) for q in prompts]
        for k, url in enumerate(listed.split(",")):  # decode reads both workers' info now,
            text_of(complete(d, [k + 1] * 20, pd_prefill=url))  # not from a frozen p1 later
        endpoint = info(p1)["transfer_endpoint"]
        os.kill(p1.proc.pid, signal.SIGSTOP)  # its hand-offs connect, then hear nothing
        moved, moved_out = in_threads(8, lambda i: complete(both, prompts[i]))
        failed, failed_out = in_threads(8, lambda i: complete(only, prompts[i]))
        deadline = time.monotonic() + 60
        while (rep := d.integrity())["running"] + rep["waiting"] < 12:  # 4 + 8 wait for p1
            assert time.monotonic() < deadline, f"requests never queued behind p1: {rep}"
            time.sleep(0.05)
        os.kill(p1.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in [*moved, *failed]:
            t.join(120)
        done = time.monotonic()
        assert [text_of(moved_out[i]) for i in range(8)] == want  # p1's four went to p2
        assert router_metric(both.url, "handoff_retries", to="other", worker=p1.url) == 4
        for i in range(8):
            r = failed_out[i]
            assert isinstance(r, httpx.Response) and r.status_code == 502, r
            msg = r.json()["error"]["message"]
            assert endpoint in msg and "unreachable" in msg, msg
        assert done - killed < SILENCE_S  # a heartbeat each, not a silence bound each
        rep = d.wait_idle()
        assert rep["ok"] and rep["accounting"]["device"]["locked"] == 0  # nothing held on
        assert p2.wait_idle()["ok"]
    finally:
        for router in (both, only):
            assert router.terminate() == 0, router.log.read_text()
        for s in (p1, p2, d):
            s.stop()

"""P/D faults when both workers run on two real gloo ranks (--tp 2): kill -9 of the whole prefill
worker (its HTTP process and both ranks) mid-hand-off, and kill -9 of a decode worker while
prefill works for it. The client gets a clear answer within the bound, every surviving worker's
pools pass the integrity check on every rank, and the next request succeeds with the right
tokens."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from tests import test_pd_faults as faults
from tests.pd_helpers import Workers, complete, info, start_all, wait_linked
from tests.serve_helpers import Server
from tests.test_pd_faults import TIMEOUT_S, idle_ok, in_thread, want

# two-rank workers (three processes each); each test starts its own: any order, any xdist worker
pytestmark = pytest.mark.slow
TP = ["--tp", "2"]
X = [(5 * i + 1) % 97 for i in range(41)]
Y = [(3 * i + 2) % 97 for i in range(33)]
Z = [(7 * i + 5) % 97 for i in range(41)]


CKPT = {"seed": 2, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def prefill_args(ckpt: Path, store: Path, *extra: str) -> list[str]:
    return faults.prefill_args(ckpt, store, *TP, *extra)


def decode_args(ckpt: Path, prefill_url: str) -> list[str]:
    return faults.decode_args(ckpt, prefill_url, *TP)


@pytest.fixture
def run(tmp_path: Path, ckpt: Path) -> Iterator[Workers]:
    """This test's own prefill p1 and decode d (two ranks each), after X and Z crossed from p1
    to d (so they are in p1's storage directory and d holds them)."""
    store = tmp_path / "store"
    (p1,) = start_all([(prefill_args(ckpt, store), tmp_path / "p1.log")])
    env = Workers(tmp_path, store, p1, p1, [p1])
    try:
        (env.d,) = env.start((decode_args(ckpt, p1.url), tmp_path / "d.log"))
        for prompt in (X, Z):  # they reach the shared store through p1
            assert complete(env.d, prompt).status_code == 200
        idle_ok(p1)
        yield env
    finally:
        for s in env.servers:
            s.stop()


def kill_worker(server: Server, sig: int) -> None:
    """The server's whole process group: its HTTP process and its ranks."""
    os.killpg(server.proc.pid, sig)


def test_prefill_worker_killed_mid_handoff(run: Workers, ckpt: Path) -> None:
    d, p1 = run.d, run.p1
    free = idle_ok(d)["device_free"]
    endpoints = info(p1)["transfer_endpoints"]
    kill_worker(p1, signal.SIGSTOP)  # no answer and no heartbeat on either rank's channel
    t0 = time.monotonic()
    t, out = in_thread(complete, d, Y)
    wait_linked(endpoints)  # both decode ranks' hand-off links are up
    kill_worker(p1, signal.SIGKILL)
    p1.proc.wait(10)
    t.join(30)
    r, t1 = out[0]
    # its links dropped with the processes: a 502 within a heartbeat, not the silence bound's
    assert r.status_code == 502, r.text
    assert "unreachable: connection lost" in r.json()["error"]["message"]
    assert t1 - t0 < TIMEOUT_S + 5
    assert idle_ok(d)["device_free"] == free  # every rank's pages for it are back
    (p2,) = run.start((prefill_args(ckpt, run.store), run.tmp / "p2.log"))
    r = complete(d, Y, pd_prefill=p2.url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want(ckpt, Y)
    idle_ok(p2)
    idle_ok(d)


def test_decode_worker_killed_while_prefill_works_for_it(run: Workers, ckpt: Path) -> None:
    slow = ["--storage-emulate-read-s-per-page", "0.5", "--no-pd-layerwise"]
    (p3,) = run.start((prefill_args(ckpt, run.store, *slow), run.tmp / "p3.log"))
    (d2,) = run.start((decode_args(ckpt, p3.url), run.tmp / "d2.log"))
    t, out = in_thread(complete, d2, Z)  # p3 reads Z's prefix from the shared storage: 2.5 s
    deadline = time.monotonic() + 20
    while True:  # wait until prefill holds a lease for it
        rep = p3.integrity()
        if rep["running"] + rep["waiting"] > 0:
            break
        assert time.monotonic() < deadline, "the hand-off never reached prefill"
        time.sleep(0.05)
    kill_worker(d2, signal.SIGKILL)
    d2.proc.wait(10)
    t.join(30)
    assert isinstance(out[0][0], httpx.HTTPError)  # its client saw the connection drop
    rep = idle_ok(p3)  # its request ran out on both ranks, the pages it held are released
    assert rep["owned"] == 0 and rep["accounting"]["host"]["locked"] == 0
    r = complete(run.d, Z, pd_prefill=p3.url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want(ckpt, Z)
    idle_ok(p3)
    idle_ok(run.d)

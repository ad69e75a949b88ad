"""P/D faults with real processes: prefill frozen then killed (kill -9) while decode waits for its
pages, a prefill slower than the timeout but alive (heartbeats), a dropped link between two live
workers (a TCP relay cut mid-hand-off: the channel reconnects), decode killed while prefill works
for it, a layout mismatch end to end. The client always gets a clear answer within the bound,
every worker's pools pass the integrity check, and the next request succeeds."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import (
    CuttableRelay,
    Workers,
    complete,
    info,
    start_all,
    wait_linked,
    worker_args,
)
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf

# each test starts its own workers (fixture `run`): any order, any xdist worker
pytestmark = pytest.mark.slow
TIMEOUT_S = 2.0
X = [(5 * i + 1) % 97 for i in range(41)]
Y = [(3 * i + 2) % 97 for i in range(33)]
Z = [(7 * i + 5) % 97 for i in range(41)]
W = [(11 * i + 4) % 97 for i in range(41)]


CKPT = {"seed": 2, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def prefill_args(ckpt: Path, store: Path, *extra: str) -> list[str]:
    beat = ["--pd-heartbeat-s", "0.2", "--pd-timeout-s", str(TIMEOUT_S)]
    return worker_args(ckpt, "--role", "prefill", *beat, *extra, store=store)


def decode_args(ckpt: Path, prefill_url: str, *extra: str) -> list[str]:
    # prefill workers and relays join at run time: requests name them (pd_prefill)
    pd = ["--pd-prefill", prefill_url, "--pd-timeout-s", str(TIMEOUT_S)]
    trust = ["--pd-trust-request-prefill"]
    return worker_args(ckpt, "--role", "decode", *pd, *trust, *extra)


@pytest.fixture
def run(tmp_path: Path, ckpt: Path) -> Iterator[Workers]:
    """This test's own prefill p1 and decode d, after X, Z and W crossed from p1 to d (so they
    are in p1's storage directory and d holds them)."""
    store = tmp_path / "store"
    (p1,) = start_all([(prefill_args(ckpt, store), tmp_path / "p1.log")])
    env = Workers(tmp_path, store, p1, p1, [p1])
    try:
        (env.d,) = env.start((decode_args(ckpt, p1.url), tmp_path / "d.log"))
        for prompt in (X, Z, W):  # they reach the shared store through p1
            assert complete(env.d, prompt).status_code == 200
        idle_ok(p1)
        yield env
    finally:
        for s in env.servers:
            s.stop()


def slow_prefill(run: Workers, ckpt: Path) -> Server:
    """A prefill on the same store whose storage reads take 0.5 s a page (X's prefix: > 2.5 s)."""
    slow = ["--storage-emulate-read-s-per-page", "0.5", "--no-pd-layerwise"]  # whole pages
    (p2,) = run.start((prefill_args(ckpt, run.store, *slow), run.tmp / "p2.log"))
    return p2


def want(ckpt: Path, prompt: list[int], n: int = 4) -> str:
    return ByteCodec(97).decode(hf_greedy(load_hf(ckpt), prompt, n))


def idle_ok(server: Server) -> dict:
    rep = server.wait_idle()
    assert rep["ok"] and rep["accounting"]["device"]["locked"] == 0
    return rep


def in_thread(fn, *args, **kw) -> tuple[threading.Thread, list]:  # noqa: ANN001
    """Run fn in a thread; its (result or exception, end time) lands in the list."""
    out: list = []

    def go() -> None:
        try:
            res = fn(*args, **kw)
        except httpx.HTTPError as exc:  # a killed server drops its connections
            res = exc
        out.append((res, time.monotonic()))

    t = threading.Thread(target=go)
    t.start()
    return t, out


def test_prefill_killed_mid_handoff(run: Workers, ckpt: Path) -> None:
    d, p1 = run.d, run.p1
    free = idle_ok(d)["device_free"]
    endpoint = info(p1)["transfer_endpoint"]
    os.kill(p1.proc.pid, signal.SIGSTOP)  # decode's hand-off gets no answer, no heartbeat
    t0 = time.monotonic()
    t, out = in_thread(complete, d, Y)
    wait_linked([endpoint])  # decode's hand-off link is up (its request cannot be answered)
    os.kill(p1.proc.pid, signal.SIGKILL)
    p1.proc.wait(10)
    t.join(30)
    r, t1 = out[0]
    # the link dropped with the process: a 502 within a heartbeat, not the silence bound's 504
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    assert endpoint in msg and "unreachable: connection lost" in msg, msg
    assert t1 - t0 < TIMEOUT_S + 5
    assert idle_ok(d)["device_free"] == free  # the request's pages are back, nothing leaked


def test_restarted_prefill_slower_than_the_timeout_but_alive(run: Workers, ckpt: Path) -> None:
    # 0.5 s per storage page read: prefill needs > 2.5 s for X's prefix; heartbeats keep decode
    # waiting
    p2 = slow_prefill(run, ckpt)
    t0 = time.monotonic()
    r = complete(run.d, X, pd_prefill=p2.url)  # decode re-resolves: a fresh channel
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert took > TIMEOUT_S  # longer than the silence bound: heartbeats, not luck
    assert r.json()["choices"][0]["text"] == want(ckpt, X)
    assert r.json()["usage"]["pd"]["pages_received"] == 1  # decode still held X's 5 pages
    assert complete(run.d, Y, pd_prefill=p2.url).json()["choices"][0]["text"] == want(ckpt, Y)
    idle_ok(p2)
    idle_ok(run.d)


def test_dropped_connection_reconnects_and_the_handoff_completes(run: Workers, ckpt: Path) -> None:
    p2, d = slow_prefill(run, ckpt), run.d
    relay = CuttableRelay(info(p2)["transfer_endpoint"])
    try:
        t0 = time.monotonic()
        t, out = in_thread(complete, d, W, pd_prefill=relay.endpoint)  # p2 reads W: 2.5 s
        deadline = time.monotonic() + 20
        while p2.integrity()["running"] + p2.integrity()["waiting"] == 0:
            assert time.monotonic() < deadline, "the hand-off never reached prefill"
            time.sleep(0.05)
        relay.cut()  # both workers live, the link between them gone mid-hand-off
        t.join(30)
        r, t1 = out[0]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want(ckpt, W)
        assert r.json()["usage"]["pd"]["pages_received"] == 1  # d holds W's 5 pages (fixture `run`)
        assert relay.accepted >= 2 and t1 - t0 > TIMEOUT_S  # reconnected, same hand-off
    finally:
        relay.close()
    idle_ok(p2)
    idle_ok(d)


def test_decode_killed_while_prefill_works_for_it(run: Workers, ckpt: Path) -> None:
    p2 = slow_prefill(run, ckpt)
    d2, d3 = run.start(
        (decode_args(ckpt, p2.url), run.tmp / "d2.log"),
        (decode_args(ckpt, p2.url, "--page-size", "16"), run.tmp / "d3.log"),
    )
    t, out = in_thread(complete, d2, Z)  # p2 reads Z's prefix from storage: 2.5 s
    deadline = time.monotonic() + 20
    while True:  # wait until prefill holds a lease for it
        rep = p2.integrity()
        if rep["running"] + rep["waiting"] > 0:
            break
        assert time.monotonic() < deadline, "the hand-off never reached prefill"
        time.sleep(0.05)
    d2.proc.kill()
    d2.proc.wait(10)
    t.join(30)
    assert isinstance(out[0][0], httpx.HTTPError)  # its client saw the connection drop
    rep = idle_ok(p2)  # its request ran out, the pages it held are released
    assert rep["owned"] == 0 and rep["accounting"]["host"]["locked"] == 0
    r = complete(run.d, Z, pd_prefill=p2.url)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want(ckpt, Z)
    r = complete(d3, X)
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    assert info(p2)["transfer_endpoint"] in msg
    assert "layout mismatch: page_size is 8 here but 16 on decode" in msg
    idle_ok(d3)
    idle_ok(p2)
    log = (run.tmp / "p2.log").read_text()
    assert "Traceback" not in log, log
    m = httpx.get(f"{p2.url}/metrics").text
    assert 'kvstrata:pd_handoffs_total{model_name="tiny",outcome="failed"} 1.0' in m


def test_prefill_killed_mid_transfer(run: Workers, ckpt: Path) -> None:
    """kill -9 of prefill while its pages stream to decode: a relay passes on the first half of
    the KV bytes prefill sends (some layers of every page have crossed), holds the rest back,
    and prefill dies. Decode uses nothing of the half transfer: a clear 504 within the bound,
    its pages back, and the same prompt then succeeds through another prefill."""
    d, tmp = run.d, run.tmp
    doomed, spare = run.start(
        (prefill_args(ckpt, tmp / "store-doomed"), tmp / "doomed.log"),
        (prefill_args(ckpt, tmp / "store-spare"), tmp / "spare.log"),
    )
    prompt = [(13 * i + 3) % 97 for i in range(65)]  # new to decode: all 9 pages must cross
    half = 9 * info(doomed)["layout"]["page_bytes"] // 2
    relay = CuttableRelay(info(doomed)["transfer_endpoint"], stall_after=half)
    free = idle_ok(d)["device_free"]
    try:
        t, out = in_thread(complete, d, prompt, pd_prefill=relay.endpoint)
        deadline = time.monotonic() + 30
        while relay.withheld == 0:  # prefill has sent more than half its pages' bytes
            assert time.monotonic() < deadline, "prefill never got past half its pages"
            time.sleep(0.01)
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait(10)
        killed = time.monotonic()
        t.join(30)
    finally:
        relay.close()
    r, t1 = out[0]
    assert r.status_code == 504, r.text
    msg = r.json()["error"]["message"]
    assert relay.endpoint in msg and f"pd_timeout_s={TIMEOUT_S}" in msg
    assert t1 - killed < TIMEOUT_S + 5
    assert idle_ok(d)["device_free"] == free  # nothing of the half transfer stayed, no leak
    r = complete(d, prompt, pd_prefill=spare.url)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want(ckpt, prompt)
    assert r.json()["usage"]["pd"]["pages_received"] == 9  # the half transfer was not kept
    idle_ok(d)
    idle_ok(spare)

"""`kvstrata serve --tp 2`: two real gloo ranks behind one HTTP server give the tokens and cache
hits of the single-rank server; streaming, a dropped stream and SIGTERM (exit 0) work there too."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
import zmq

from tests.serve_helpers import (
    TINY_ENGINE,
    Server,
    alive,
    apply_events,
    metrics_when,
    reserved_ports,
    subscribed,
)

PROMPTS = [[(11 * i + k) % 97 for i in range(33 + 8 * k)] for k in range(3)]


CKPT = {"seed": 6, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def served(srv: Server) -> list[tuple[str, int]]:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for p in [*PROMPTS, PROMPTS[0]]:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
        out.append((r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens))
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True
    )
    out.append(("".join(c.choices[0].text for c in stream), -1))
    return out


def consensus_counted(metrics: str) -> bool:
    """/metrics holds a step consensus latency count above 0."""
    count = [
        x for x in metrics.splitlines() if x.startswith("kvstrata:step_consensus_seconds_count")
    ]
    return bool(count) and float(count[0].rsplit(" ", 1)[1]) > 0


def blocks_from_events(
    port: int, srv: Server, run: Callable[[], Any]
) -> tuple[Any, dict[str, set[int]]]:
    """Run `run()` while subscribed to the KV events; the per-medium sets the events add up to
    once they equal the idle server's own (/debug/blocks; 30 s at most). A quiet spell is no
    proof that the last batch has gone out on a loaded machine; the server's own sets are."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    held: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "DISK": set()}
    try:
        subscribed(sub, f"tcp://127.0.0.1:{port}")  # before the first event
        result = run()
        srv.wait_idle()
        own = httpx.get(f"{srv.url}/debug/blocks", timeout=30).json()
        own = {m: set(v) for m, v in own.items()}
        deadline = time.monotonic() + 30
        while held != own and time.monotonic() < deadline:
            if sub.poll(200):
                apply_events(sub.recv_multipart()[2], held)
        assert held == own, f"events add up to {held}, the server holds {own}"
    finally:
        sub.close()
        ctx.term()
    return result, held


@pytest.mark.slow
def test_tp2_server_equals_one_rank(ckpt: Path, tmp_path: Path) -> None:
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "64"]
    with reserved_ports(2) as ports:  # held until each server binds its own
        tp2_equals_one_rank(args, ports, tmp_path)


def tp2_equals_one_rank(args: list[str], ports: tuple[int, ...], tmp_path: Path) -> None:
    events = ["--kv-events-endpoint", f"tcp://127.0.0.1:{ports[0]}", "--debug-endpoints"]
    one = Server([*args, *events], tmp_path / "one.log")
    try:
        want, blocks_one = blocks_from_events(ports[0], one, lambda: served(one))
    finally:
        assert one.terminate() == 0
    events = ["--kv-events-endpoint", f"tcp://127.0.0.1:{ports[1]}"]
    two = Server([*args, "--tp", "2", *events, "--debug-endpoints"], tmp_path / "two.log")
    try:
        got, blocks_two = blocks_from_events(ports[1], two, lambda: served(two))
        assert got == want
        assert blocks_two == blocks_one and blocks_one["GPU"] and blocks_one["CPU"]
        two.wait_idle()
        own = httpx.get(f"{two.url}/debug/blocks", timeout=30).json()  # checked on both ranks
        assert {m: set(v) for m, v in own.items()} == blocks_two
        assert (
            want[3][1] == 32
        )  # the repeated prompt: its 4 full pages from device memory, on both ranks
        body = {"prompt": PROMPTS[2], "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{two.url}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # then the client goes away: every rank aborts it
        again = openai.OpenAI(base_url=f"{two.url}/v1", api_key="none", max_retries=0)
        r2 = again.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0)
        assert r2.choices[0].text == want[0][0]
        assert two.wait_idle()["ok"]  # the dropped stream's pages are back, on every rank
        reset = httpx.post(f"{two.url}/reset_prefix_cache?reset_external=true", timeout=60)
        assert reset.json() == {"success": True}  # every rank, between the same two steps
        own = httpx.get(f"{two.url}/debug/blocks", timeout=30).json()
        assert own == {"GPU": [], "CPU": [], "DISK": []}
        r3 = again.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0)
        assert (
            r3.choices[0].text == want[0][0] and r3.usage.prompt_tokens_details.cached_tokens == 0
        )
        # rank 0 reports pools and agreement latencies every 0.5 s
        metrics = metrics_when(two.url, consensus_counted, "a consensus latency count > 0")
        assert consensus_counted(metrics)
        assert 'kvstrata:kv_cache_usage_perc{model_name="tiny",pool="device"}' in metrics
        assert "kvstrata:kv_moved_bytes_total" in metrics
    finally:
        assert two.terminate(timeout_s=120) == 0, (tmp_path / "two.log").read_text()
    assert "Traceback" not in (tmp_path / "two.log").read_text()


def test_ranks_end_when_their_server_is_killed(ckpt: Path, tmp_path: Path) -> None:
    """kill -9 of `serve --tp 2`'s HTTP process: its rank processes stop by themselves (they
    would otherwise hold memory, ports and P/D endpoints forever)."""
    srv = Server(["--model", str(ckpt), *TINY_ENGINE, "--tp", "2"], tmp_path / "s.log")
    tasks = Path(f"/proc/{srv.proc.pid}/task").glob("*/children")  # forked by a thread
    kids = [int(c) for t in tasks for c in t.read_text().split()]
    assert len(kids) == 2 and all(alive(k) for k in kids)
    srv.proc.kill()
    srv.proc.wait(10)
    deadline = time.monotonic() + 20  # PARENT_POLL_S + ORPHAN_GRACE_S, with room on a busy box
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)], "rank processes outlived their server"


def test_server_whose_rank_died_exits_naming_it(ckpt: Path, tmp_path: Path) -> None:
    """kill -9 of one of `serve --tp 2`'s rank processes (gloo): the ranks stop naming it within
    --timeout-s, and the server then exits non-zero (it used to answer 503 for ever, so an
    orchestrator never learned it had to restart it); the other rank is gone too."""
    args = ["--model", str(ckpt), *TINY_ENGINE, "--tp", "2", "--timeout-s", "10"]
    srv = Server(args, tmp_path / "s.log")
    try:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).status_code == 200
        tasks = Path(f"/proc/{srv.proc.pid}/task").glob("*/children")  # forked by a thread
        kids = sorted(int(c) for t in tasks for c in t.read_text().split())
        assert len(kids) == 2
        os.kill(kids[-1], signal.SIGKILL)
        code = srv.proc.wait(120)  # the bound of this test, not a timing claim
        log = (tmp_path / "s.log").read_text()
        assert code == 1, log
        assert "rank 1" in log and "killed by SIGKILL" in log, log
        assert "exiting, the ranks stopped" in log, log
        deadline = time.monotonic() + 20
        while alive(kids[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(kids[0]), "the surviving rank outlived its server"
    finally:
        srv.stop()

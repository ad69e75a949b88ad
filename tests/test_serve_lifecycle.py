"""`kvstrata serve` lifecycle and KV events: SIGTERM under load exits 0 and the next start hits
the store; a ZMQ subscriber rebuilds the cache's per-medium block sets from the events (live and
through the replay socket) and finds them equal to the cache's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import zmq

from kvstrata.cache.event_wire import BlockRemoved, decode_batch
from tests.serve_helpers import (
    TINY_ENGINE,
    Server,
    alive,
    apply_events,
    reserved_ports,
    subscribed,
)

PAGE = 8
ROOT = Path(__file__).resolve().parents[1]


CKPT = {"seed": 2, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def prompt(offset: int, n: int = 41) -> list[int]:
    return [(5 * i + 1 + offset) % 97 for i in range(n)]


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def tiered(ckpt: Path, store: Path) -> list[str]:
    return [
        "--model", str(ckpt), *TINY_ENGINE, "--device-pages", "40", "--host-pages", "64",
        "--storage-url", f"file://{store}", "--prefetch-policy", "wait_complete",
        "--debug-endpoints",
    ]  # fmt: skip


def test_sigterm_under_load_exits_0_and_restart_hits_the_store(ckpt: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    srv = Server(tiered(ckpt, store), tmp_path / "a.log")
    try:
        first = client_of(srv).completions.create(
            prompt=prompt(0), model="tiny", max_tokens=4, temperature=0
        )
        results: list[str] = []

        def load(i: int) -> None:
            try:
                s = client_of(srv).completions.create(
                    prompt=prompt(10 + i), model="tiny", max_tokens=200, temperature=0, stream=True
                )
                n = sum(1 for _ in s)
                results.append(f"ok {n}")
            except Exception as exc:  # noqa: BLE001 - a stopped server may cut a stream short
                results.append(type(exc).__name__)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # streams are under way
        assert srv.terminate(timeout_s=90) == 0, (tmp_path / "a.log").read_text()
        for t in threads:
            t.join(30)
            assert not t.is_alive()  # no client hangs on a stopped server
        assert len(results) == 6
    finally:
        srv.stop()
    assert "Traceback" not in (tmp_path / "a.log").read_text()
    again = Server(tiered(ckpt, store), tmp_path / "b.log")
    try:
        r = client_of(again).completions.create(
            prompt=prompt(0), model="tiny", max_tokens=4, temperature=0
        )
        tiers = r.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
        assert tiers == {"device": 0, "host": 0, "storage": 40}  # all 5 pages from storage
        assert r.choices[0].text == first.choices[0].text  # KV from storage: the same tokens
        assert again.wait_idle()["ok"]
    finally:
        assert again.terminate() == 0


def test_kv_events_rebuild_the_cache(ckpt: Path, tmp_path: Path) -> None:
    with reserved_ports(2) as (pub, rep):  # held until the server binds them
        args = [
            *tiered(ckpt, tmp_path / "store"),
            "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}",
            "--kv-events-topic", "kv",
        ]  # fmt: skip
        srv = Server(args, tmp_path / "ev.log")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        subscribed(sub, f"tcp://127.0.0.1:{pub}")  # before the first event
        client = client_of(srv)
        for i in range(
            8
        ):  # 8 sessions x 2 turns through a 40-page device pool: evictions, host, storage
            for turn in range(2):
                client.completions.create(
                    prompt=prompt(i, 41 + 24 * turn), model="tiny", max_tokens=6, temperature=0
                )
        srv.wait_idle()
        own = {m: set(v) for m, v in httpx.get(f"{srv.url}/debug/blocks").json().items()}
        assert own["GPU"] and own["CPU"] and own["DISK"]
        held: dict[str, set[int]] = {m: set() for m in own}
        seqs, payloads, removed = [], [], 0
        deadline = time.monotonic() + 30
        while held != own and time.monotonic() < deadline:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv" and len(seq) == 8
                seqs.append(int.from_bytes(seq, "big"))
                payloads.append(payload)
                removed += sum(isinstance(ev, BlockRemoved) for ev in decode_batch(payload).events)
                apply_events(payload, held)
        assert held == own
        assert seqs == list(range(len(seqs)))  # gap-free from 0
        assert (
            removed > 0
        )  # device memory was too small: pages left the device and the events said so
        replayed = replay(ctx, rep, 0)
        assert replayed[: len(payloads)] == list(zip(seqs, payloads, strict=True))
        assert replay(ctx, rep, 3)[0][0] == 3
    finally:
        sub.close()
        ctx.term()
        assert srv.terminate() == 0


def replay(ctx: zmq.Context, port: int, start: int) -> list[tuple[int, bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert sock.poll(10_000), "replay socket did not answer within 10 s"
            seq, payload = sock.recv_multipart()[-2:]  # [delimiter, topic, seq, payload]
            if seq == (-1).to_bytes(8, "big", signed=True):
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


def test_queue_full_is_503_then_recovers(ckpt: Path, tmp_path: Path) -> None:
    args = ["--model", str(ckpt), *TINY_ENGINE, "--max-pending", "2", "--debug-endpoints"]
    srv = Server(args, tmp_path / "q.log")
    try:
        url = f"{srv.url}/v1/completions"
        body = {"prompt": prompt(0, 30), "max_tokens": 300, "temperature": 0}
        codes: list[int] = []
        errors: list[dict] = []

        def one() -> None:
            r = httpx.post(url, json=body, timeout=120)
            codes.append(r.status_code)
            if r.status_code != 200:
                errors.append(r.json()["error"])

        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert set(codes) == {200, 503} and len(codes) == 12  # 2 in flight at most, rest refused
        assert all(e["code"] == 503 and "busy" in e["message"] for e in errors)
        assert srv.wait_idle()["ok"]
        r = httpx.post(url, json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    finally:
        assert srv.terminate() == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--port", "70000"], "port must be in"),
        (["--max-pending", "0"], "max_pending must be positive"),
        (["--tiers", "device_host_storage"], "needs --storage-url"),
        (["--storage-url", "ftp://x"], "ftp"),
        (["--kv-events-replay-endpoint", "tcp://127.0.0.1:1"], "needs kv_events_endpoint"),
        (["--kv-events-replay-budget", "0"], "kv_events_replay_budget must be positive"),
    ],
)
def test_bad_serve_options_exit_2(args: list[str], words: str, capsys) -> None:  # noqa: ANN001
    from kvstrata.cli.main import main

    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_not_a_checkpoint_exits_2(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from kvstrata.cli.main import main

    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "kvstrata serve: error:" in capsys.readouterr().err


def test_a_parent_pid_that_is_not_our_parent_exits_2(capsys) -> None:  # noqa: ANN001
    from kvstrata.cli.main import main

    assert main(["serve", "--parent-pid", str(os.getpid())]) == 2  # never our own parent
    assert "is not this process's parent" in capsys.readouterr().err


LAUNCHER = """
import sys, time
from pathlib import Path
from kvstrata.serve.process import ServerProcess
srv = ServerProcess(sys.argv[2:], Path(sys.argv[1]))
print(srv.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_server_ends_when_its_launcher_is_killed(ckpt: Path, tmp_path: Path) -> None:
    """kill -9 of what started a server (`kvstrata run`'s P/D row, a benchmark): the server,
    in its own session so no signal of the launcher's group reaches it, stops by itself."""
    args = [str(tmp_path / "s.log"), "--model", str(ckpt), *TINY_ENGINE]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *args], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = launcher.stdout.readline()  # type: ignore[union-attr]  # bounded: start timeout
        assert line.strip().isdigit(), f"no server started: {(tmp_path / 's.log').read_text()}"
        pid = int(line)
        assert alive(pid)
    finally:
        launcher.kill()
        launcher.wait(10)
    deadline = time.monotonic() + 30  # PARENT_POLL_S + a graceful stop, with room on a busy box
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    outlived = alive(pid)
    if outlived:
        os.kill(pid, signal.SIGKILL)  # a failing run leaves no server behind either
    assert not outlived, "the server outlived its launcher"

"""`kvstrata serve --role router --replicas A,B` as real processes: two replicas sharing a file
store, each publishing vLLM-format KV events. The router's index equals each replica's own
/debug/blocks; a session's next turn goes where its pages are, predicted cached tokens equal the
reported ones; two salts never share a match; vLLM's own decoder reads every batch a replica
published; Dynamo's real indexer, fed by the same events, routes the same way; a replica killed
mid-stream is retried around, leaves the routing set, and is re-indexed when it returns."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgpack
import pytest
import zmq

from kvstrata.bench.vllm_server import VLLM_BIN
from kvstrata.cache.event_wire import BlockStored, decode_batch
from kvstrata.local_ports import free_port
from kvstrata.router.rule import session_replica
from kvstrata.serve.process import ServerProcess
from tests.pd_helpers import start_all
from tests.serve_helpers import TINY_ENGINE, Server, reserved_ports

pytestmark = pytest.mark.slow  # several real server processes

CKPT = {"seed": 5, "max_position_embeddings": 512}
PAGE = 8
ROOT = Path(__file__).resolve().parent.parent
DYNAMO_PY = ROOT / ".venv-dynamo" / "bin" / "python"
DYNAMO_FAILED = ROOT / ".venv-dynamo" / ".kvstrata-dynamo-failed"


def prompt(seed: int, n: int = 41) -> list[int]:
    return [(7 * i + 3 * seed + 1) % 97 for i in range(n)]


@dataclass
class Replicas:
    servers: list[Server]
    specs: list[tuple[list[str], Path, int]]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]


@pytest.fixture(scope="module")
def replicas(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    logs, store = tmp_path_factory.mktemp("fleet"), tmp_path_factory.mktemp("store")
    base = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "64", "--host-pages", "64",
            "--storage-url", f"file://{store}", "--debug-endpoints"]  # fmt: skip
    with reserved_ports(4) as ports:  # held until the servers bind them
        specs = [
            ([*base, "--kv-events-endpoint", f"tcp://127.0.0.1:{ports[2 * i]}",
              "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{ports[2 * i + 1]}"],
             logs / f"replica{i}.log", free_port())
            for i in range(2)
        ]  # fmt: skip
        servers = start_all(specs)
    reps = Replicas(servers, specs)
    try:
        yield reps
    finally:
        for s in reps.servers:
            s.stop()


def start_router(reps: Replicas, log: Path, *extra: str) -> ServerProcess:
    args = ["--role", "router", "--replicas", ",".join(reps.urls), "--debug-endpoints",
            "--router-health-interval-s", "1", *extra]  # fmt: skip
    return ServerProcess(args, log, 60)


@pytest.fixture(scope="module")
def router(replicas: Replicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = start_router(replicas, tmp_path_factory.mktemp("router") / "router.log")
    yield proc.url
    assert proc.terminate() == 0, proc.log.read_text()


def complete(router: str, body: dict[str, Any], session: str | None = None) -> dict[str, Any]:
    headers = {"x-session-id": session} if session else {}
    r = httpx.post(f"{router}/v1/completions", json={"model": "tiny", "max_tokens": 2,
                   "temperature": 0, **body}, headers=headers, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    return dict(r.json()["usage"]["prompt_tokens_details"])


def metric(router: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{router}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = rf"^kvstrata:router_{name}(?:_total)?(?:\{{{re.escape(want)}\}})? (\S+)$"
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


def settle(router: str, reps: Replicas, timeout_s: float = 20.0) -> dict[str, Any]:
    """Once every replica is idle: the router's index, once it equals every live replica's own
    /debug/blocks (AssertionError naming the difference after timeout_s)."""
    for s in reps.servers:
        s.wait_idle()
    deadline = time.monotonic() + timeout_s
    while True:
        index = httpx.get(f"{router}/debug/fleet/blocks", timeout=10).json()
        own = {url: httpx.get(f"{url}/debug/blocks", timeout=10).json() for url in index}
        if index == own:
            return index
        if time.monotonic() > deadline:
            assert index == own
        time.sleep(0.1)


def served_by(router: str, url: str) -> float:
    return metric(router, "requests", role="replica", worker=url)


def test_sessions_follow_their_pages_and_predictions_hold(router: str, replicas: Replicas) -> None:
    a, b = replicas.urls
    sessions = {u: next(f"s{i}" for i in range(100) if session_replica(f"s{i}", [a, b]) == u)
                for u in (a, b)}  # fmt: skip
    for n, (url, session) in enumerate(sessions.items()):
        before = served_by(router, url)
        first = complete(router, {"prompt": prompt(n)}, session)  # no prefix: the session's home
        assert first["cached_tokens"] == 0 and served_by(router, url) == before + 1
        settle(router, replicas)
        # the next turn: the first 40 tokens (5 pages) are held on `url`'s device
        nxt = complete(router, {"prompt": prompt(n) + [5, 6, 7]}, session)
        assert nxt["cached_tokens_by_tier"]["device"] == 40 and served_by(router, url) == before + 2
        settle(router, replicas)
    # a text chat goes through a replica's /tokenize: its second turn is found too
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi " * 30}]}
    for _ in range(2):
        r = httpx.post(f"{router}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        settle(router, replicas)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # a stream: its usage chunk is read as the bytes pass
    body = {"model": "tiny", "prompt": prompt(0) + [9], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage[-1]["prompt_tokens_details"]["cached_tokens"] == 40
    settle(router, replicas)
    assert metric(router, "cached_tokens_predictions", outcome="unequal") == 0
    assert metric(router, "cached_tokens_predictions", outcome="equal") == 7
    assert metric(router, "predicted_cached_tokens") == metric(router, "reported_cached_tokens") > 0


def test_two_salts_never_share_a_match(router: str, replicas: Replicas) -> None:
    p = prompt(20)
    complete(router, {"prompt": p, "cache_salt": "tenant-a"})
    settle(router, replicas)
    prefix_before = metric(router, "routing_decisions", reason="prefix")
    again = complete(router, {"prompt": p, "cache_salt": "tenant-a"})
    assert again["cached_tokens"] == 40
    assert metric(router, "routing_decisions", reason="prefix") == prefix_before + 1
    settle(router, replicas)
    session_before = metric(router, "routing_decisions", reason="session")
    other = complete(router, {"prompt": p, "cache_salt": "tenant-b"})  # same tokens, other tenant
    assert other["cached_tokens"] == 0
    assert metric(router, "routing_decisions", reason="session") == session_before + 1
    unsalted = complete(router, {"prompt": p}, "someone")
    assert unsalted["cached_tokens"] == 0
    settle(router, replicas)
    assert metric(router, "cached_tokens_predictions", outcome="unequal") == 0


def test_round_robin_takes_turns(replicas: Replicas, tmp_path: Path) -> None:
    rt = start_router(replicas, tmp_path / "rr.log", "--routing", "round_robin")
    try:
        for _ in range(4):  # one session, one prompt: still in turn
            complete(rt.url, {"prompt": prompt(60)}, "same")
            settle(rt.url, replicas)
        assert [served_by(rt.url, u) for u in replicas.urls] == [2, 2]
        assert metric(rt.url, "routing_decisions", reason="round_robin") == 4
        assert metric(rt.url, "cached_tokens_predictions", outcome="unequal") == 0
    finally:
        assert rt.terminate() == 0, rt.log.read_text()


def replayed(endpoint: str) -> list[bytes]:
    """Every batch the replica's replay socket still buffers, as published."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    out = []
    try:
        while True:
            assert sock.poll(10_000), f"no replay from {endpoint}"
            seq, payload = sock.recv_multipart()[-2:]  # [delimiter, topic, seq, payload]
            if int.from_bytes(seq, "big", signed=True) < 0:
                return out
            out.append(payload)
    finally:
        sock.close()
        ctx.term()


VLLM_DECODE = """
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
for payload in msgspec.msgpack.decode(open(sys.argv[1], "rb").read()):
    batch = dec.decode(payload)
    out = []
    for e in batch.events:
        row = [type(e).__name__]
        if isinstance(e, (BlockStored, BlockRemoved)):
            row += [e.block_hashes, e.medium]
        if isinstance(e, BlockStored):
            row += [e.parent_block_hash, len(e.token_ids), e.block_size,
                    [list(k) if k else None for k in (e.extra_keys or [])], e.group_idx]
        out.append(row)
    print(json.dumps([batch.data_parallel_rank, out]))
"""


def test_vllms_decoder_reads_every_batch(replicas: Replicas, tmp_path: Path) -> None:
    python = VLLM_BIN.parent / "python"
    assert python.exists(), f"{python} missing: run scripts/setup_vllm.sh (scripts/test.sh does)"
    srv = replicas.servers[0]
    body = {"model": "tiny", "prompt": prompt(30), "max_tokens": 2, "cache_salt": "tenant-v"}
    assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
    srv.wait_idle()
    endpoint = replicas.specs[0][0][replicas.specs[0][0].index("--kv-events-replay-endpoint") + 1]
    payloads = replayed(endpoint)
    (tmp_path / "batches").write_bytes(msgpack.packb(payloads))
    run = subprocess.run([str(python), "-c", VLLM_DECODE, str(tmp_path / "batches")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = [json.loads(line) for line in run.stdout.splitlines()]
    ours = []
    for payload in payloads:
        batch = decode_batch(payload)
        rows = []
        for e in batch.events:
            row: list[Any] = [type(e).__name__]
            if not hasattr(e, "block_hashes"):
                rows.append(row)
                continue
            row += [e.block_hashes, e.medium]  # type: ignore[union-attr]
            if isinstance(e, BlockStored):
                extra = [[s] if s else None for s in e.salts]
                row += [e.parent_block_hash, len(e.token_ids), e.block_size, extra, 0]
            rows.append(row)
        ours.append([batch.data_parallel_rank, rows])
    assert theirs == ours and len(ours) > 0
    media = {row[2] for _, rows in ours for row in rows if row[0] == "BlockStored"}
    assert media == {"GPU", "CPU", "DISK"}  # device, host and the shared store
    salted = [r for _, rows in ours for r in rows if r[0] == "BlockStored" and r[6][0]]
    assert all(r[6] == [r[6][0]] * len(r[1]) for r in salted)  # every block carries its salt
    assert {"tenant-v", "tenant-a", "tenant-b"} >= {r[6][0][0] for r in salted} >= {"tenant-v"}


def _dynamo_or_skip() -> None:
    if DYNAMO_PY.exists() and not DYNAMO_FAILED.exists():
        return
    why = DYNAMO_FAILED.read_text().strip() if DYNAMO_FAILED.exists() else "no .venv-dynamo"
    pytest.skip(f"Dynamo's indexer is not installed ({why}); scripts/setup_dynamo.sh makes it")


def test_dynamos_indexer_routes_by_our_events(replicas: Replicas, tmp_path: Path) -> None:
    _dynamo_or_skip()
    port = free_port()
    log = (tmp_path / "indexer.log").open("w")
    indexer = subprocess.Popen([str(DYNAMO_PY), "-m", "dynamo.indexer", "--port", str(port),
                                "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/workers", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "indexer.log").read_text()
            time.sleep(0.2)
        rt = start_router(replicas, tmp_path / "router.log", "--kv-indexer-url", url)
        try:
            _route_through_dynamo(rt.url, url, replicas)
        finally:
            assert rt.terminate() == 0, rt.log.read_text()
    finally:
        indexer.terminate()
        indexer.wait(30)
        log.close()


def _route_through_dynamo(router: str, indexer: str, replicas: Replicas) -> None:
    workers = httpx.get(f"{indexer}/workers", timeout=10).json()
    assert sorted(w["instance_id"] for w in workers) == [1, 2]
    assert {w["block_size"] for w in workers} == {PAGE}
    p = prompt(40)
    complete(router, {"prompt": p})
    for s in replicas.servers:
        s.wait_idle()
    ask = {"token_ids": p[:40], "model_name": "kvstrata"}
    deadline = time.monotonic() + 20
    while True:  # the indexer applies our events on its own time
        found = httpx.post(f"{indexer}/query", json=ask, timeout=10).json()["instances"]
        holders = [i for i, t in found.items() if t.get("gpu") == 40]
        if holders:
            break
        assert time.monotonic() < deadline, found
        time.sleep(0.2)
    assert len(holders) == 1 and found[holders[0]]["cpu"] == 40
    holder = replicas.urls[int(holders[0]) - 1]
    before = served_by(router, holder)
    again = complete(router, {"prompt": p + [1, 2]}, "another-session")
    assert (
        again["cached_tokens_by_tier"]["device"] == 40 and served_by(router, holder) == before + 1
    )
    assert metric(router, "cached_tokens_predictions", outcome="unequal") == 0
    assert metric(router, "indexer_failures") == 0


def test_a_replica_killed_and_restarted(router: str, replicas: Replicas, tmp_path: Path) -> None:
    a, b = replicas.urls
    session = next(f"k{i}" for i in range(100) if session_replica(f"k{i}", [a, b]) == b)
    # a router whose health rounds are too far apart to notice first: b refuses the request
    slow = start_router(replicas, tmp_path / "slow.log", "--router-health-interval-s", "60")
    try:
        replicas.servers[1].stop()  # SIGKILL
        usage = complete(slow.url, {"prompt": prompt(50)}, session)  # retried on a
        assert usage["cached_tokens"] == 0
        assert metric(slow.url, "replica_retries", replica=b) == 1
        assert served_by(slow.url, a) == 1 and served_by(slow.url, b) == 0
        assert httpx.get(f"{slow.url}/health", timeout=10).json()["down"] == [b]
    finally:
        assert slow.terminate() == 0, slow.log.read_text()
    # the module's router (a round a second) drops b and its entries at its next round
    deadline = time.monotonic() + 10
    while httpx.get(f"{router}/health", timeout=10).json()["down"] != [b]:
        assert time.monotonic() < deadline, "b not out of the routing set"
        time.sleep(0.1)
    assert list(httpx.get(f"{router}/debug/fleet/blocks", timeout=10).json()) == [a]
    before = served_by(router, a)
    complete(router, {"prompt": prompt(51)}, session)  # b's sessions re-hash (to a)
    assert served_by(router, a) == before + 1
    args, log, port = replicas.specs[1]
    replicas.servers[1] = Server(args, log.with_suffix(".2.log"), port=port)  # same sockets
    deadline = time.monotonic() + 20
    while httpx.get(f"{router}/health", timeout=10).json()["down"]:
        assert time.monotonic() < deadline, "b not back in the routing set"
        time.sleep(0.1)
    body = {"model": "tiny", "prompt": prompt(52), "max_tokens": 2}
    assert httpx.post(f"{b}/v1/completions", json=body, timeout=60).status_code == 200
    index = settle(router, replicas)  # b's pages indexed again from its new stream
    assert index[b]["GPU"]
    before = served_by(router, b)
    assert complete(router, {"prompt": prompt(52)}, session)["cached_tokens"] == 40
    assert served_by(router, b) == before + 1

"""P/D with a real redis-server as the shared storage: a prefix that reached Redis through one
decode worker's turn is read from Redis by another decode worker that never saw it, so prefill sends
it only the last page; the output equals transformers' greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import complete, info, start_all, worker_args
from tests.redis_server import RedisServer
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf

pytestmark = pytest.mark.slow  # a redis-server and three worker processes
PROMPT = [(7 * i + 3) % 97 for i in range(41)]  # 41 tokens: 5 full pages + 1 token


CKPT = {"seed": 4, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[dict]:
    redis = RedisServer().start()
    try:
        with shared_storage_workers(tmp_path_factory.mktemp("pdr-logs"), ckpt, redis.url) as w:
            yield w
    finally:
        redis.stop()


@contextmanager
def shared_storage_workers(tmp: Path, ckpt: Path, url: str) -> Iterator[dict]:
    """A prefill and two decode workers sharing the storage at `url` (also used by the mooncake
    test)."""
    storage = ["--storage-url", url, "--prefetch-policy", "wait_complete"]
    servers: list[Server] = []
    try:
        (p,) = start_all([(worker_args(ckpt, "--role", "prefill", *storage), tmp / "p.log")])
        servers.append(p)
        decode = ["--role", "decode", "--pd-prefill", p.url, *storage]
        servers += start_all([(worker_args(ckpt, *decode), tmp / f"d{i}.log") for i in (1, 2)])
        yield {"p": servers[0], "d1": servers[1], "d2": servers[2]}
    finally:
        for s in servers:
            s.stop()
    for log in tmp.glob("*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()


def test_prefix_in_shared_redis_is_not_sent(workers: dict, ckpt: Path) -> None:
    assert_prefix_not_sent(workers, ckpt)


def assert_prefix_not_sent(workers: dict, ckpt: Path) -> None:
    page_bytes = info(workers["p"])["layout"]["page_bytes"]
    first = complete(workers["d1"], PROMPT)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["pd"]["pages_received"] == 6  # cold: every page crossed
    for name in ("p", "d1", "d2"):  # idle: every backup of the prompt is committed in Redis
        rep = workers[name].wait_idle()
        assert rep["ok"] and rep["accounting"]["device"]["locked"] == 0
    r = complete(workers["d2"], PROMPT)  # d2 never saw it: only Redis (and prefill) has it
    assert r.status_code == 200, r.text
    pd = r.json()["usage"]["pd"]
    assert pd["pages_from_storage"] == 5 and pd["pages_skipped"] == 5
    assert pd["pages_received"] == 1 and pd["bytes_received"] == page_bytes
    want = ByteCodec(97).decode(hf_greedy(load_hf(ckpt), PROMPT, 4))
    assert r.json()["choices"][0]["text"] == first.json()["choices"][0]["text"] == want
    for name in ("p", "d1", "d2"):
        assert workers[name].wait_idle()["ok"]

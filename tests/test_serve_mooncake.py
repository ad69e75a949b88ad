"""Two `kvstrata serve` processes on one real mooncake_master, each with its own Mooncake client
contributing a segment: a prefix the first served is a storage hit for the second, with the same
output (transformers' greedy tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.serve.codec import ByteCodec
from tests.mooncake_server import master
from tests.pd_helpers import complete, start_all, worker_args
from tests.serve_helpers import Server
from tests.tiny_models import hf_greedy, load_hf, make_llama

pytestmark = pytest.mark.slow  # a mooncake_master and two server processes
PROMPT = [(5 * i + 2) % 97 for i in range(41)]  # 41 tokens: 5 full pages + 1 token


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("smc") / "tiny", seed=6, max_position_embeddings=512)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("smc-logs")
    m = master()
    storage = [
        "--storage-url",
        m.url(segment="32m", buffer="16m"),
        "--prefetch-policy",
        "wait_complete",
    ]
    started: list[Server] = []
    try:
        started = start_all([(worker_args(ckpt, *storage), tmp / f"{n}.log") for n in ("a", "b")])
        yield {"a": started[0], "b": started[1]}
    finally:
        for s in started:
            s.stop()
        m.stop()
    for log in tmp.glob("*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()


def _tiers(r: object) -> dict[str, int]:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]  # type: ignore[attr-defined]


def test_prefix_served_by_one_server_is_a_storage_hit_for_the_other(
    servers: dict, ckpt: Path
) -> None:
    first = complete(servers["a"], PROMPT)
    assert first.status_code == 200, first.text
    assert _tiers(first) == {"device": 0, "host": 0, "storage": 0}
    rep = servers["a"].wait_idle()  # idle: its backups of the prompt are committed in Mooncake
    assert rep["ok"]
    second = complete(servers["b"], PROMPT)  # b never saw it: only Mooncake has it
    assert second.status_code == 200, second.text
    assert _tiers(second) == {"device": 0, "host": 0, "storage": 40}
    want = ByteCodec(97).decode(hf_greedy(load_hf(ckpt), PROMPT, 4))
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"] == want
    for s in servers.values():
        assert s.wait_idle()["ok"]

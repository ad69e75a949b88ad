"""kvstrata inside the real vLLM (CPU build, .venv-vllm): outputs, exact cached tokens, storage.

One multi-turn workload, sessions round robin, whose histories exceed vLLM's KV space (16
blocks of 32 tokens): vLLM alone evicts what the next turn needs; with kvstrata every turn's
shared prefix comes back from host pages or, after a restart, from storage (file store).
Every turn's prompt is the previous turn's prompt plus new tokens, so the exact cached count
of turn t > 0 is the full blocks of turn t-1's prompt.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from kvstrata.bench.vllm_bench import multi_turn
from kvstrata.bench.vllm_server import VllmServer
from kvstrata.cache.keys import Namespace, page_keys
from kvstrata.memory.layout import KVShape
from kvstrata.model.smollm2 import ensure_smollm2
from kvstrata.storage.file_store import PAGE_SUFFIX
from kvstrata.storage.units import UnitLayout
from tests.redis_server import RedisServer
from tests.tiny_models import make_llama

pytestmark = pytest.mark.slow

BLOCK = 32
LAYERS = 30  # SmolLM2-135M
SESSIONS, TURNS, FIRST, GROW, OUT = 3, 3, 160, 48, 4


def workload() -> list[list[int]]:
    """Prompts in send order: turn by turn, each session once per turn."""
    return multi_turn(SESSIONS, TURNS, FIRST, GROW)


def expected_cached(prompts: list[list[int]]) -> list[int]:
    """Full blocks of the same session's previous prompt (0 on a first turn)."""
    return [
        0 if i < SESSIONS else len(prompts[i - SESSIONS]) // BLOCK * BLOCK
        for i in range(len(prompts))
    ]


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_smollm2()


def corrupt_unit(storage: Path, model: Path, prompt: list[int], page: int) -> None:
    """Flip one payload byte of the first storage unit of `page` of `prompt` in the file storage."""
    ns = Namespace(model_fingerprint=str(model), kv_dtype="float32", page_size=BLOCK)
    key = page_keys(prompt[: (page + 1) * BLOCK], ns)[page]
    # SmolLM2: 30 layers, 3 KV heads of 64; the connector's units: every layer x 1 head
    unit = UnitLayout(KVShape(30, 3, 64, BLOCK), layer_block=30).unit_key(key, ((0, 30), (0, 1)))
    name = f"{unit:032x}"
    path = storage / name[:2] / f"{name}{PAGE_SUFFIX}"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def metric(text: str, name: str, label: str, value: str) -> float:
    """Counter `name` with label `label`="`value`" in a /metrics text (0 if absent)."""
    pat = re.compile(r"^" + name + r"\{[^}]*" + label + '="' + value + r'"[^}]*\} (\S+)$', re.M)
    m = pat.search(text)
    return float(m.group(1)) if m else 0.0


def tier_hits(server: VllmServer, tier: str) -> float:
    """vllm:kvstrata_hit_tokens_total for `tier` from the server's /metrics (0 if absent)."""
    return metric(server.metrics(), "vllm:kvstrata_hit_tokens_total", "tier", tier)


def by_source(text: str, source: str) -> float:
    """vLLM's own vllm:prompt_tokens_cached_by_source_total for `source`."""
    return metric(text, "vllm:prompt_tokens_cached_by_source_total", "source", source)


def wait_tier_hits(server: VllmServer, tier: str, want: float, timeout_s: float = 30) -> float:
    """The tier's counter once it reached `want` (stats ride the engine's outputs), or the last."""
    return wait_metric(server, "vllm:kvstrata_hit_tokens_total", "tier", tier, want, timeout_s)


def wait_metric(
    server: VllmServer, name: str, label: str, value: str, want: float, timeout_s: float = 30
) -> float:
    """Counter `name`{label=value} once it reached `want`, or its last value after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (got := metric(server.metrics(), name, label, value)) < want:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return got


def run(server: VllmServer, prompts: list[list[int]]) -> tuple[list[str], list[int]]:
    outs = [server.complete(p, max_tokens=OUT) for p in prompts]
    return [o.text for o in outs], [o.cached_tokens for o in outs]


@pytest.fixture(scope="module")
def alone(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[int]]:
    """vLLM without the connector on the workload: its texts and cached counts."""
    log = tmp_path_factory.mktemp("alone") / "vllm_alone.log"
    with VllmServer(model, log) as server:
        return run(server, workload())


def test_vllm_with_kvstrata_host_then_storage_after_restart(
    model: Path, tmp_path: Path, alone: tuple[list[str], list[int]]
) -> None:
    prompts = workload()
    texts_alone, cached_alone = alone
    assert cached_alone != expected_cached(prompts), "the workload must exceed vLLM's KV space"
    extra = {
        "host_pages": 256,
        "storage_url": f"file://{tmp_path / 'storage'}",
        "check_integrity": True,  # tree and pools checked after every step: a fault stops vLLM
    }
    with VllmServer(model, tmp_path / "vllm_kvstrata.log", connector=extra) as kvs:
        texts, cached = run(kvs, prompts)
        assert tier_hits(kvs, "host") > 0 and tier_hits(kvs, "storage") == 0
        # vLLM's own per-source counter gets the same split (host -> "host", storage -> "disk")
        text = kvs.metrics()
        assert by_source(text, "host") == metric(
            text, "vllm:kvstrata_hit_tokens_total", "tier", "host"
        )
        assert by_source(text, "disk") == 0
        assert wait_idle(kvs) == 0.0  # write_through keeps no block past its request
    assert texts == texts_alone
    assert cached == expected_cached(prompts)
    # a fresh server (empty host pool, vLLM's cache cold) on the same storage: every prompt's full
    # blocks but the one holding its last token come back from storage
    last = prompts[-SESSIONS:]
    corrupt_unit(
        tmp_path / "storage", model, last[0], page=2
    )  # session 0 reads 2 pages, recomputes
    with VllmServer(model, tmp_path / "vllm_restart.log", connector=extra) as again:
        texts2, cached2 = run(again, last)
        salted = again.complete(last[0], max_tokens=OUT, salt="tenant-b")
        # vLLM's own cache and kvstrata's host memory started cold: every cached token came from
        # storage
        assert wait_tier_hits(again, "storage", sum(cached2)) == sum(cached2)
        assert tier_hits(again, "host") == 0
        text = again.metrics()
        assert (by_source(text, "disk"), by_source(text, "host")) == (sum(cached2), 0)
    assert texts2 == texts[-SESSIONS:]
    assert cached2 == [2 * BLOCK] + [(len(p) - 1) // BLOCK * BLOCK for p in last[1:]]
    assert salted.cached_tokens == 0 and salted.text == texts2[0]


def test_two_live_servers_share_redis_then_redis_dies_mid_run(
    model: Path, tmp_path: Path, alone: tuple[list[str], list[int]]
) -> None:
    """Server A backs turn 0 up to redis; server B, started while A runs (copies layer by layer),
    gets every turn-1 history from redis; then redis dies under A: misses, never a hang."""
    prompts = workload()
    turn1 = slice(SESSIONS, 2 * SESSIONS)
    filler = np.random.default_rng(5).integers(100, 40000, 100).tolist()
    with RedisServer() as redis:
        extra = {"host_pages": 256, "storage_url": redis.url, "check_integrity": True}
        with VllmServer(model, tmp_path / "vllm_redis.log", connector=extra) as kvs:
            first = run(kvs, prompts[:SESSIONS])
            kvs.complete(filler, max_tokens=OUT)  # more steps: the last prompt's backups commit
            assert redis_keys(redis.port) > 0, "write-through pages were backed up to redis"
            layer = {**extra, "copy_mode": "layer"}
            log_b = tmp_path / "vllm_redis_b.log"
            with VllmServer(model, log_b, connector=layer) as other:
                shared = run(other, prompts[turn1])
                from_storage = wait_tier_hits(other, "storage", sum(shared[1]))
                calls = [
                    wait_metric(other, "vllm:kvstrata_layer_calls_total", "call", c, LAYERS * 3)
                    for c in ("wait", "save")
                ]
            redis.kill()
            rest = run(kvs, prompts[SESSIONS:])  # storage probes and backups fail: misses
    assert shared == (alone[0][turn1], expected_cached(prompts)[turn1])
    assert from_storage == sum(shared[1])  # B's vLLM cache and host memory started cold
    # each request: one step loads its history (vLLM waited for every layer's load), and stores
    # its one new full page (vLLM saved every layer)
    assert calls == [LAYERS * 3, LAYERS * 3]
    text_b = log_b.read_text()
    assert "saved no KV" not in text_b and "waited for no load" not in text_b
    assert first[0] + rest[0] == alone[0]
    assert first[1] + rest[1] == expected_cached(prompts)  # host memory still holds every history


def redis_keys(port: int) -> int:
    import redis as redis_client

    return int(redis_client.Redis(port=port).dbsize())


def tiny_tp_model(path: Path, smollm2: Path) -> Path:
    """A random Llama vLLM's CPU attention takes (4 heads, 2 KV heads of 64) with SmolLM2's
    tokenizer, so tensor parallel 2 gives each worker one KV head."""
    make_llama(
        path,
        seed=3,
        vocab_size=49152,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        num_hidden_layers=2,
        max_position_embeddings=1024,
    )
    for f in smollm2.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
            shutil.copy(f, path / f.name)
    return path


def test_tp2_store_is_a_tp1_hit_and_back(model: Path, tmp_path: Path) -> None:
    """TP=1 and TP=2 servers live at once on one file store: each hits what the other stored."""
    tiny = tiny_tp_model(tmp_path / "tiny", model)
    extra = {
        "host_pages": 64,
        "storage_url": f"file://{tmp_path / 'storage'}",
        "check_integrity": True,
    }
    rng = np.random.default_rng(1)
    one, two, filler = (rng.integers(100, 40000, n).tolist() for n in (200, 200, 100))
    full = (len(one) - 1) // BLOCK * BLOCK  # every full block but the one with the last token
    tp2 = VllmServer(
        tiny,
        tmp_path / "vllm_tp2.log",
        connector=extra,
        extra_args=("--tensor-parallel-size", "2"),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    with VllmServer(tiny, tmp_path / "vllm_tp1.log", connector=extra) as tp1:
        stored_by_1 = tp1.complete(one, max_tokens=OUT)
        tp1.complete(filler, max_tokens=OUT)  # more steps: the first prompt's backups commit
        with tp2:  # each worker reads (and writes) only its own KV head's units
            read_by_2 = tp2.complete(one, max_tokens=OUT)
            stored_by_2 = tp2.complete(two, max_tokens=OUT)
            tp2.complete(filler[::-1], max_tokens=OUT)
        # committed only once both workers wrote: TP=1 reads both heads' units
        read_by_1 = tp1.complete(two, max_tokens=OUT)
    assert (stored_by_1.cached_tokens, stored_by_2.cached_tokens) == (0, 0)
    assert (read_by_2.cached_tokens, read_by_1.cached_tokens) == (full, full)
    assert (read_by_2.text, read_by_1.text) == (stored_by_1.text, stored_by_2.text)


def kv_usage(server: VllmServer) -> float:
    """vLLM's own gauge of its KV space in use (0 when every block is free or only cached)."""
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", server.metrics(), re.M)
    assert m is not None, "vllm:kv_cache_usage_perc missing from /metrics"
    return float(m.group(1))


def wait_idle(server: VllmServer, timeout_s: float = 30) -> float:
    """vLLM's KV usage once it is back to 0, or its last value after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (usage := kv_usage(server)) != 0.0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return usage


def distinct_pages(prompts: list[list[int]]) -> int:
    """Full pages computed over all prompts and their first OUT - 1 generated tokens (whose KV
    vLLM computes), counted once: here every such page lies inside its prompt."""
    pages = set()
    for p in prompts:
        n_full = (len(p) + OUT - 1) // BLOCK
        assert n_full <= len(p) // BLOCK, "a full page holding generated tokens"
        pages.update(tuple(p[: (i + 1) * BLOCK]) for i in range(n_full))
    return len(pages)


def test_write_back_stores_each_page_once_when_its_request_ends(
    model: Path, tmp_path: Path, alone: tuple[list[str], list[int]]
) -> None:
    """write_back: a page is copied to host memory when the request holding it ends, from vLLM's
    blocks, which vLLM keeps until the copy ran (delay_free, then finished_sending). Outputs equal
    vLLM alone; every turn's shared prefix is a host hit; each distinct page is stored and backed
    up exactly once; vLLM's KV space is back to idle (no block kept)."""
    prompts = workload()
    extra = {
        "host_pages": 256,
        "storage_url": f"file://{tmp_path / 'storage'}",
        "write_policy": "write_back",
        "check_integrity": True,  # tree and pools checked after every step: a fault stops vLLM
    }
    page_bytes = LAYERS * 3 * 64 * BLOCK * 2 * 4  # SmolLM2: 3 KV heads of 64, K and V, fp32
    pages = distinct_pages(prompts)
    with VllmServer(model, tmp_path / "vllm_write_back.log", connector=extra) as kvs:
        texts, cached = run(kvs, prompts)
        assert wait_idle(kvs) == 0.0
        kvs.complete(list(range(7, 7 + BLOCK - 8)), max_tokens=1)  # a step: the last backups go
        moved = "vllm:kvstrata_moved_bytes_total"
        stored = wait_metric(kvs, moved, "kind", "store", pages * page_bytes)
        backed = wait_metric(kvs, moved, "kind", "backup", pages * page_bytes)
        assert wait_idle(kvs) == 0.0
    assert texts == alone[0]
    assert cached == expected_cached(prompts)
    assert (stored, backed) == (pages * page_bytes, pages * page_bytes)

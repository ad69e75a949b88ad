"""The engine over every tier equals recomputation: logits of turn k are the same whether its
prefix comes from device, host (forced demotion), storage (a fresh engine sharing the file store) or
no cache."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.storage.base import StorageConfig
from kvstrata.storage.config import storage_config
from tests.tiny_models import rel_err

torch.set_num_threads(1)
PAGE = 8


CKPT = {"seed": 3, "max_position_embeddings": 1024}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def model(ckpt: Path):  # noqa: ANN201
    return load_model(ckpt)


def conversation(turns: int, seed: int = 0) -> list[list[int]]:
    """Turn k's prompt = turn k-1's prompt + new tokens (the history grows)."""
    rng = random.Random(seed)
    hist: list[int] = []
    out = []
    for _ in range(turns):
        hist = hist + [rng.randrange(5, 97) for _ in range(rng.randrange(20, 50))]
        out.append(list(hist))
    return out


def run_turns(
    model,
    tiers: str,
    storage: Path,
    prompts: list[list[int]],
    device_pages: int = 64,
    host_pages: int = 64,
    demote: bool = False,
    chunk: int = 1024,
    storage_url: str = "",
    storage_cfg: StorageConfig | None = None,
):  # noqa: ANN001, ANN201
    cfg = CacheConfig(
        page_size=PAGE,
        device_pages=device_pages,
        host_pages=host_pages,
        storage_url=storage_url or f"file://{storage}",
        prefetch_policy="wait_complete",
    )
    built = build_engine(
        EngineConfig(chunk_tokens=chunk, max_batch_tokens=1024),
        cfg.with_tiers(tiers),
        storage_cfg,
        model=model,
    )
    eng = built.engine
    results = []
    for prompt in prompts:
        req = Request(f"t{len(results)}", prompt, max_new_tokens=4, keep_logits=True)
        eng.submit(req)
        while eng.has_work():
            eng.step()
            eng.check_integrity()
        results.append(req)
        eng.drain()
        if demote and eng.cache is not None:  # push every cached page out of device memory
            ids = eng.cache.alloc_device(eng.cache.tiers.device.num_free)
            eng.cache.tiers.evict_device(device_pages)
            eng.cache.drain()
            eng.cache.free_device(ids)
        eng.check_integrity()
    built.close()
    return results


def cached_pages(prev: Request, cur: list[int]) -> int:
    """Pages of `cur` that `prev` left cached: full pages of the tokens whose KV it wrote
    (prompt + output but the last token) that `cur` shares, within `cur`'s hittable pages."""
    written = (prev.tokens + prev.output)[:-1]
    common = 0
    while common < min(len(written), len(cur)) and written[common] == cur[common]:
        common += 1
    return min(common // PAGE, (len(cur) - 1) // PAGE)


def assert_same(a, b) -> None:  # noqa: ANN001
    for ra, rb in zip(a, b, strict=True):
        assert ra.output == rb.output
        for la, lb in zip(ra.logits, rb.logits, strict=True):
            assert rel_err(la, lb) <= 1e-4


def turns_from_every_tier(
    model: Any, tmp: Path, prompts: list[list[int]], stored_turns: int, **kw: Any
) -> list[Request]:
    """The turns from device, host (forced demotion) and storage (a fresh engine over a store the
    first `stored_turns` filled) equal the cold turns, with exact hit counts; the storage run."""
    ref = run_turns(model, "none", tmp / "s0", prompts, **kw)
    device = run_turns(model, "device", tmp / "s1", prompts, **kw)
    assert_same(ref, device)
    hit = cached_pages(device[-2], prompts[-1])
    assert hit > 0 and device[-1].hits == {"device": hit, "host": 0, "storage": 0}
    host = run_turns(model, "device_host", tmp / "s2", prompts, demote=True, **kw)
    assert_same(ref, host)
    assert host[-1].hits == {"device": 0, "host": cached_pages(host[-2], prompts[-1]), "storage": 0}
    run_turns(model, "device_host_storage", tmp / "s3", prompts[:stored_turns], **kw)
    storage = run_turns(model, "device_host_storage", tmp / "s3", prompts, **kw)  # same store
    assert_same(ref, storage)
    return storage


def test_turns_equal_across_tiers(model, tmp_path: Path) -> None:  # noqa: ANN001
    prompts = conversation(4)
    storage = turns_from_every_tier(model, tmp_path, prompts, stored_turns=2)
    first = (len(prompts[0]) - 1) // PAGE  # turn 0's prompt pages, all stored by the first run
    assert storage[0].hits == {"device": 0, "host": 0, "storage": first}
    in_device = cached_pages(
        storage[0], prompts[1]
    )  # what turn 0 left in this engine's device memory
    assert storage[1].hits == {
        "device": in_device,
        "host": 0,
        "storage": (len(prompts[1]) - 1) // PAGE - in_device,
    }


def test_a_reload_larger_than_host_memory_equals_the_cold_run(model, tmp_path: Path) -> None:  # noqa: ANN001
    """Host memory of 3 pages under a stored prefix of more: the reload reads the 3 leading
    pages, the engine computes the rest, and the logits equal recomputation."""
    prompts = conversation(2)
    stored = (len(prompts[1]) - 1) // PAGE
    assert stored > 3
    ref = run_turns(model, "none", tmp_path / "s0", prompts[1:])
    run_turns(model, "device_host_storage", tmp_path / "s1", prompts[1:])
    small = run_turns(model, "device_host_storage", tmp_path / "s1", prompts[1:], host_pages=3)
    assert_same(ref, small)
    assert small[0].hits == {"device": 0, "host": 0, "storage": 3}


def test_chunked_prefill_and_batching_equal_single_shot(model, tmp_path: Path) -> None:  # noqa: ANN001
    prompts = conversation(3, seed=5)
    alone = run_turns(model, "none", tmp_path / "a", prompts)
    chunked = run_turns(model, "none", tmp_path / "b", prompts, chunk=16)
    assert_same(alone, chunked)
    cfg = CacheConfig(page_size=PAGE, device_pages=128, host_pages=0)
    built = build_engine(EngineConfig(chunk_tokens=32, max_batch_tokens=64), cfg, model=model)
    reqs = [Request(f"b{i}", p, max_new_tokens=4, keep_logits=True) for i, p in enumerate(prompts)]
    built.engine.run(reqs)
    built.engine.check_integrity()
    assert_same(alone, reqs)
    built.close()


def _turns_in_fresh_process(ckpt: str, store: str, prompts: list[list[int]], out: str) -> None:
    """Child process: a new engine on the same checkpoint and file store."""
    torch.set_num_threads(1)
    reqs = run_turns(load_model(ckpt), "device_host_storage", Path(store), prompts)
    torch.save([(r.output, r.logits, r.hits) for r in reqs], out)


def test_storage_hits_in_a_fresh_process(model, ckpt: Path, tmp_path: Path) -> None:  # noqa: ANN001
    import multiprocessing as mp

    prompts = conversation(3, seed=9)
    ref = run_turns(model, "none", tmp_path / "unused", prompts)
    run_turns(
        model, "device_host_storage", tmp_path / "store", prompts
    )  # this process fills the store
    out = tmp_path / "child.pt"
    proc = mp.get_context("spawn").Process(
        target=_turns_in_fresh_process, args=(str(ckpt), str(tmp_path / "store"), prompts, str(out))
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    child = torch.load(out)
    for r, (output, logits, _hits) in zip(ref, child, strict=True):
        assert output == r.output
        assert all(rel_err(a, b) <= 1e-4 for a, b in zip(logits, r.logits, strict=True))
    # the very first turn of the new process hits storage: every prompt page but the last token's
    assert child[0][2] == {"device": 0, "host": 0, "storage": (len(prompts[0]) - 1) // PAGE}


def test_a_batch_that_does_not_fit_waits(model, tmp_path: Path) -> None:  # noqa: ANN001
    prompts = [conversation(2, seed=11 + i)[1] for i in range(3)]  # no shared prefixes
    alone = run_turns(model, "none", tmp_path / "a", prompts)
    need = max(-(-(len(p) + 3) // PAGE) for p in prompts)
    cfg = CacheConfig(page_size=PAGE, device_pages=need + 2, host_pages=0)
    built = build_engine(EngineConfig(chunk_tokens=64, max_batch_tokens=128), cfg, model=model)
    reqs = [Request(f"w{i}", p, max_new_tokens=4, keep_logits=True) for i, p in enumerate(prompts)]
    for r in reqs:
        built.engine.submit(r)
    max_running = 0
    while built.engine.has_work():
        built.engine.step()
        built.engine.check_integrity()
        max_running = max(max_running, len(built.engine.running))
    assert max_running == 1  # only one fits at a time; the others waited instead of failing
    assert_same(alone, reqs)
    built.close()


def test_bad_requests_are_refused(model, tmp_path: Path) -> None:  # noqa: ANN001
    built = build_engine(
        EngineConfig(),
        CacheConfig(page_size=PAGE, device_pages=32, host_pages=0),
        model=model,
    )
    with pytest.raises(ValueError, match="empty prompt"):
        built.engine.submit(Request("e", []))
    with pytest.raises(ValueError, match="exceed"):
        built.engine.submit(Request("long", [1] * 1100))
    with pytest.raises(ValueError, match="out of range"):
        built.engine.submit(Request("oov", [1, 2, 500]))
    with pytest.raises(ValueError, match="pages"):
        built.engine.submit(Request("big", [1] * 600))
    assert not built.engine.has_work()
    built.close()


def test_a_prompt_may_fill_every_position(model) -> None:  # noqa: ANN001
    """The last generated token is never fed back, so prompt + new - 1 positions are used."""
    limit = model.spec.max_position_embeddings  # 1024
    built = build_engine(
        EngineConfig(),
        CacheConfig(page_size=PAGE, device_pages=limit // PAGE + 1, host_pages=0),
        model=model,
    )
    with pytest.raises(ValueError, match="exceed"):
        built.engine.submit(Request("over", [1] * limit, max_new_tokens=2))
    req = Request("full", [1] * (limit - 1), max_new_tokens=2)
    assert built.engine.run([req]) == [req] and len(req.output) == 2
    built.engine.check_integrity()
    built.close()


def test_redis_as_shared_storage_across_engines(model, tmp_path: Path) -> None:  # noqa: ANN001
    """Two engines (as two workers would) share a real redis-server as storage: the second one's
    first turn comes from storage and equals recomputation; a dead server only costs hits."""
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        prompts = conversation(3, seed=21)
        ref = run_turns(model, "none", tmp_path / "unused", prompts)
        run_turns(model, "device_host_storage", tmp_path, prompts, storage_url=server.url)
        second = run_turns(model, "device_host_storage", tmp_path, prompts, storage_url=server.url)
        assert_same(ref, second)
        assert second[0].hits == {"device": 0, "host": 0, "storage": (len(prompts[0]) - 1) // PAGE}
        server.kill()  # the storage is gone: misses, same tokens, no exception
        lenient = storage_config(require_reachable_at_start=False)
        third = run_turns(
            model,
            "device_host_storage",
            tmp_path,
            prompts,
            storage_url=server.url,
            storage_cfg=lenient,
        )
        assert_same(ref, third)
        assert third[0].hits["storage"] == 0
    finally:
        server.stop()

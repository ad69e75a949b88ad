"""Prefix-cache reset in the engine: device memory forgotten (host kept unless asked), refused while
requests run, and with reset_running the running requests are preempted and recompute: their tokens
and logits equal a run without any reset. Integrity is checked after every step and every reset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.events import snapshot
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.ranks.rank_engine import tree_digest
from tests.tiny_models import make_llama, rel_err

torch.set_num_threads(1)
PAGE = 8
PROMPTS = [[(7 * i + 3 * k) % 97 for i in range(29 + 10 * k)] for k in range(3)]  # 29, 39, 49


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return load_model(make_llama(tmp_path_factory.mktemp("llama") / "ckpt", seed=4))


def engine(model, host_pages: int = 64) -> Engine:  # noqa: ANN001
    cfg = CacheConfig(page_size=PAGE, device_pages=48, host_pages=host_pages)
    ecfg = EngineConfig(chunk_tokens=16, max_batch_tokens=64, max_running=4)
    return build_engine(ecfg, cfg, model=model).engine


def run(eng: Engine, reqs: list[Request], reset_at: int = -1) -> int:
    """Step to the end; at step `reset_at` reset with reset_running. The number of requests
    the reset found running."""
    for r in reqs:
        eng.submit(r)
    preempted = 0
    while eng.has_work():
        if eng.steps == reset_at:
            preempted = len(eng.running)
            assert eng.reset_prefix_cache(reset_running=True)
            eng.check_integrity()
            assert eng.cache is not None and not snapshot(eng.cache.tree)["GPU"]
        eng.step()
        eng.check_integrity()
    return preempted


def requests(tag: str, new: int = 12) -> list[Request]:
    return [Request(f"{tag}{i}", p, new, keep_logits=True) for i, p in enumerate(PROMPTS)]


def test_reset_forgets_device_and_with_drop_host(model) -> None:  # noqa: ANN001
    eng = engine(model)
    first = requests("a", 2)
    run(eng, first)
    eng.drain()
    cache = eng.cache
    assert cache is not None
    held = snapshot(cache.tree)
    assert len(held["GPU"]) == 3 + 5 + 6  # full pages of each prompt + its first new token
    assert eng.reset_prefix_cache()
    eng.check_integrity()
    after = snapshot(cache.tree)
    assert after["GPU"] == set() and after["CPU"] == held["CPU"] and held["CPU"]
    assert cache.accounting()["device"] == {"free": 48, "cached": 0, "locked": 0, "in_flight": 0}
    again = [Request("b", PROMPTS[2], 2, keep_logits=True)]
    run(eng, again)
    assert again[0].hits == {
        "device": 0,
        "host": 6,
        "storage": 0,
    }  # all 6 hittable pages, from host memory
    assert again[0].output == first[2].output
    eng.drain()
    assert eng.reset_prefix_cache(drop_host=True)
    eng.check_integrity()
    assert list(cache.tree.nodes()) == [] and cache.resets == 2
    assert cache.accounting()["host"]["free"] == 64
    last = [Request("c", PROMPTS[2], 2)]
    run(eng, last)
    assert last[0].hits == {"device": 0, "host": 0, "storage": 0}


def test_refused_while_running_unless_preempting(model) -> None:  # noqa: ANN001
    eng = engine(model)
    for r in requests("a"):
        eng.submit(r)
    for _ in range(4):
        eng.step()
    assert eng.running
    cache = eng.cache
    assert cache is not None
    before = tree_digest(cache)
    assert not eng.reset_prefix_cache()  # requests run: nothing changes
    assert tree_digest(cache) == before and cache.resets == 0
    assert cache.busy_pages() > 0


@pytest.mark.parametrize("reset_at", [2, 5, 9])  # mid-prefill, just decoding, decoding
def test_preempted_requests_equal_an_undisturbed_run(model, reset_at: int) -> None:  # noqa: ANN001
    ref = requests("r")
    run(engine(model), ref)
    got = requests("r")
    eng = engine(model)
    assert run(eng, got, reset_at) > 0
    assert eng.cache is not None and eng.cache.resets == 1
    for a, b in zip(got, ref, strict=True):
        assert a.output == b.output and a.finish_reason == b.finish_reason == "length"
        assert len(a.logits) == len(b.logits) == 12
        assert max(rel_err(x, y) for x, y in zip(a.logits, b.logits, strict=True)) <= 1e-4


def test_reset_without_host_tier_drops_everything(model, tmp_path: Path) -> None:  # noqa: ANN001
    eng = engine(model, host_pages=0)
    run(eng, requests("a", 2))
    eng.drain()
    assert eng.reset_prefix_cache()
    eng.check_integrity()
    assert eng.cache is not None and list(eng.cache.tree.nodes()) == []

"""Engine additions the server needs: per-request sampling (greedy unchanged, seeded sampling
reproducible, stop tokens), abort in every state with pages released at once, and cache_salt
keeping tenants' pages apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.lease import LeaseState
from kvstrata.engine.build import Built, build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request, State
from kvstrata.engine.sampling import Sampler, SamplingParams
from kvstrata.model.checkpoint import load_model
from tests.tiny_models import hf_greedy, load_hf

torch.set_num_threads(1)
PAGE = 8
PROMPT = [(3 * i + 2) % 97 for i in range(45)]


CKPT = {"seed": 4, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def model(ckpt: Path):  # noqa: ANN201
    return load_model(ckpt)


def engine(model, tiers: str = "device_host", device_pages: int = 64) -> Built:  # noqa: ANN001
    cfg = CacheConfig(page_size=PAGE, device_pages=device_pages, host_pages=64)
    return build_engine(
        EngineConfig(chunk_tokens=16, max_batch_tokens=64), cfg.with_tiers(tiers), model=model
    )


def sampled(rid: str, **kw: object) -> Request:
    return Request(rid, list(PROMPT), 10, sampler=Sampler(SamplingParams(**kw), rid))  # type: ignore[arg-type]


def test_greedy_sampler_is_argmax_and_matches_transformers(model, ckpt: Path) -> None:  # noqa: ANN001
    built = engine(model)
    plain, greedy = Request("a", list(PROMPT), 10), sampled("b", temperature=0.0)
    built.engine.run([plain, greedy])
    assert greedy.output == plain.output == hf_greedy(load_hf(ckpt), PROMPT, 10)
    built.close()


def test_seeded_sampling_is_reproducible_and_seed_dependent(model) -> None:  # noqa: ANN001
    built = engine(model)
    reqs = [sampled(f"r{i}", temperature=1.0, top_p=0.95, seed=s) for i, s in enumerate((5, 5, 6))]
    built.engine.run(reqs)
    assert reqs[0].output == reqs[1].output  # same seed, other request id: same tokens
    assert reqs[0].output != reqs[2].output
    built.engine.check_integrity()
    built.close()


def test_top_p_tiny_keeps_only_the_argmax() -> None:
    row = torch.tensor([0.1, 3.0, 0.2, 2.9])
    s = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=0), "x")
    assert {s.sample(row) for _ in range(20)} == {1}


def test_stop_token_ends_the_request(model) -> None:  # noqa: ANN001
    built = engine(model)
    probe = Request("p", list(PROMPT), 10)
    built.engine.run([probe])
    stop = probe.output[3]
    first = probe.output.index(stop)
    req = sampled("s", temperature=0.0, stop_token_ids=frozenset({stop}))
    built.engine.run([req])
    assert req.output == probe.output[: first + 1] and req.finish_reason == "stop"
    assert probe.finish_reason == "length"
    built.engine.check_integrity()
    built.close()


@pytest.mark.parametrize("steps", [0, 1, 2, 5])  # waiting, mid-prefill, prefilled, decoding
def test_abort_releases_pages_at_once(model, steps: int) -> None:  # noqa: ANN001
    built = engine(model)
    eng = built.engine
    free0 = eng.pool.allocator.num_free
    eng.submit(Request("keep", [(i + 50) % 97 for i in range(30)], 4))
    eng.submit(Request("gone", list(PROMPT), 40))
    for _ in range(steps):
        eng.step()
    gone = eng.abort("gone")
    assert gone is not None and gone.state is State.DONE and gone.finish_reason == "abort"
    assert eng.abort("gone") is None
    eng.check_integrity()
    assert all(r.rid != "gone" for r in eng.running + eng.waiting)
    assert not (set(gone.page_table[gone.computed // PAGE :]) & eng.cache.owned)
    eng.run([])
    eng.drain()
    eng.check_integrity()
    cached = sum(len(n) for n in eng.cache.tree.nodes() if n.device is not None)
    assert eng.pool.allocator.num_free + cached == free0  # nothing leaked
    assert eng.cache.accounting()["device"]["locked"] == 0
    built.close()


def test_cache_salt_separates_tenants(model) -> None:  # noqa: ANN001
    built = engine(model)
    eng = built.engine
    a1, b1 = (
        Request("a1", list(PROMPT), 2, cache_salt="a"),
        Request("b1", list(PROMPT), 2, cache_salt="b"),
    )
    eng.run([a1])
    eng.run([b1])
    a2, plain = Request("a2", list(PROMPT), 2, cache_salt="a"), Request("n", list(PROMPT), 2)
    eng.run([a2])
    eng.run([plain])
    full = (len(PROMPT) - 1) // PAGE
    assert sum(b1.hits.values()) == 0 and sum(plain.hits.values()) == 0
    assert a2.hits["device"] == full
    keys = {r.rid: set(r.lease.keys) for r in (a1, b1, plain)}  # type: ignore[union-attr]
    assert not keys["a1"] & keys["b1"] and not keys["a1"] & keys["n"]
    assert a1.output == b1.output == plain.output  # the salt changes keys, never tokens
    built.close()


def test_abort_while_probing_or_prefetching_from_storage(model, tmp_path: Path) -> None:  # noqa: ANN001
    url = f"file://{tmp_path / 'store'}"
    cfg = CacheConfig(page_size=PAGE, device_pages=64, host_pages=64, storage_url=url)
    ecfg = EngineConfig(chunk_tokens=16, max_batch_tokens=64)
    first = build_engine(ecfg, cfg, model=model)
    first.engine.run([Request("fill", list(PROMPT), 2)])
    first.close()  # every page backed up to the store
    seen = set()
    for steps in range(4):
        built = build_engine(ecfg, cfg, model=model)
        eng = built.engine
        eng.submit(Request("r", list(PROMPT), 4))
        for _ in range(steps):
            eng.step()
        req = eng.waiting[0] if eng.waiting else eng.running[0]
        seen.add(req.lease.state if req.lease is not None else LeaseState.NEW)
        assert eng.abort("r") is not None
        eng.check_integrity()
        eng.drain()  # the probe / prefetch still lands in the cache, unowned by any request
        eng.check_integrity()
        assert eng.cache.accounting()["device"]["locked"] == 0 and not eng.cache.owned
        built.close()
    assert LeaseState.PROBING in seen or LeaseState.PREFETCHING in seen


def test_a_row_that_cannot_be_sampled_stops_that_request_only() -> None:
    """NaN logits made torch.multinomial raise inside the step (failing every running request);
    the sampler now marks its request failed and stops it, deterministically on every rank."""
    row = torch.zeros(10)
    row[3] = float("nan")
    s = Sampler(SamplingParams(temperature=0.7, seed=1), "r")
    tok = s.sample(row)
    assert 0 <= tok < 10 and s.failed is not None and "cannot sample" in s.failed
    assert s.stops(tok)
    ok = Sampler(SamplingParams(temperature=0.7, seed=1), "r2")
    ok.sample(torch.zeros(10))
    assert ok.failed is None and not ok.stops(0)

"""Seed-scale prompt on the parallel engine: a 128k-token prompt under cp=2 (host hit of the next
turn) and cp=1 (storage hit, pages written by the cp=2 ranks); logits equal recomputation.

The model is the smallest that still has every part: 2 layers (the cp gather of layer l+1
overlaps layer l; host loads land layer by layer), 1 head of dim 8, vocab 97, long positions.
Attention is O(n^2): one from-scratch 128k prefill costs ~10 s per layer-head here, so the run
holds two (the reference and the cp=2 first turn, shared by 2 ranks); the hits compute only
the 40-token suffix. Chunks of 8192 tokens: 4096 and 16384 cost the same or more (measured).
The compared logits are those of the 2 generated tokens (keep_logits), as in every engine test.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.rank_engine import RankOptions, run_distributed
from tests.tiny_models import make_llama, rel_err

torch.set_num_threads(1)
N, PAGE = 131072, 64


class _Turns:
    """r0 (the long prompt) first; r1 (prompt + suffix) once r0 finished."""

    def __init__(self, reqs: list[Request]) -> None:
        self.reqs, self.sent = reqs, 0

    def poll(self, finished: list[Request]) -> list[Request] | None:
        if self.sent == 0 or (finished and self.sent < len(self.reqs)):
            self.sent += 1  # the first request, or the next one after the previous finished
            return [self.reqs[self.sent - 1]]
        if finished:  # the last one finished
            return None
        return []


def _serve(ckpt: Path, tiers: str, url: str, reqs: list[Request]) -> dict[str, Request]:
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=8192, chunk_tokens=8192)
    built = build_engine(ecfg, _cfg(url).with_tiers(tiers))
    eng, done = built.engine, {}
    for r in reqs:
        eng.submit(r)
    while eng.has_work():
        done.update((r.rid, r) for r in eng.step().ended)
    built.close()
    return done


def _cfg(url: str) -> CacheConfig:
    pages = N // PAGE + 64
    return CacheConfig(
        page_size=PAGE,
        device_pages=pages,
        host_pages=pages,
        storage_url=url,
        prefetch_policy="wait_complete",
    )


@pytest.mark.slow
def test_128k_prompt_cp2_host_hit_then_cp1_storage_hit(tmp_path: Path) -> None:
    ckpt = make_llama(
        tmp_path / "ckpt", seed=5, hidden_size=8, intermediate_size=16, head_dim=8,
        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=N + 256,
    )  # fmt: skip
    rng = random.Random(0)
    prompt = [rng.randrange(5, 97) for _ in range(N)]
    follow = prompt + [rng.randrange(5, 97) for _ in range(40)]

    def reqs() -> list[Request]:
        return [Request("r0", prompt, 1), Request("r1", follow, 2, keep_logits=True)]

    ref = _serve(ckpt, "none", "", [reqs()[1]])["r1"]
    url = str(tmp_path / "storage")
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=8192, chunk_tokens=8192)
    res = run_distributed(
        ecfg, _cfg(url), DistConfig(cp=2), _Turns(reqs()),
        options=RankOptions(demote_when_idle=True), timeout_s=900,
    )  # fmt: skip
    full = N // PAGE
    for r in res:
        assert r["hits"]["r1"]["host"] == full  # every page of the prompt back from host memory
        assert abs(2 * r["owned_host_pages"] - r["cached_host_pages"]) <= 2  # 1/cp each
        for a, b in zip(r["logits"]["r1"], ref.logits, strict=True):
            assert rel_err(torch.from_numpy(a), b) <= 1e-4
    again = _serve(ckpt, "device_host_storage", url, [reqs()[1]])["r1"]
    assert again.hits["storage"] == full
    for a, b in zip(again.logits, ref.logits, strict=True):
        assert rel_err(a, b) <= 1e-4

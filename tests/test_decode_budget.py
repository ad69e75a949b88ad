"""The decode-latency budget (`EngineConfig.decode_step_tokens`): while requests decode, a step
carries every decode and at most the budget's rest of prefill, so a long prompt arriving
mid-decode goes through in chunks and the running requests still get one token every step;
tokens equal each request's cold run (alone, on a fresh engine) and transformers' greedy ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request, State
from kvstrata.model.checkpoint import load_model
from tests.tiny_models import hf_greedy, load_hf

torch.set_num_threads(1)
PAGE, NEW, LONG = 8, 24, 150
SHORT = [[(5 * i + 1 + r) % 97 for i in range(20)] for r in range(2)]
PROMPT = [(7 * i + 3) % 97 for i in range(LONG)]

CKPT = {"seed": 6, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def model(ckpt: Path):  # noqa: ANN201
    return load_model(ckpt)


def _engine(model, decode_step_tokens: int):  # noqa: ANN001, ANN202
    cfg = EngineConfig(tiers="device", max_batch_tokens=256, decode_step_tokens=decode_step_tokens)
    return build_engine(cfg, CacheConfig(page_size=PAGE, device_pages=96), model=model)


def _mid_decode(model, budget: int) -> tuple[list[Request], list[tuple[int, int, int, int]]]:  # noqa: ANN001
    """Two short requests decode; the long one arrives once they do. Per step from then on:
    (new tokens of short 0, of short 1, prompt tokens the long one computed)."""
    built = _engine(model, budget)
    eng = built.engine
    short = [Request(f"s{r}", list(toks), NEW) for r, toks in enumerate(SHORT)]
    for req in short:
        eng.submit(req)
    while not all(r.state is State.DECODE for r in short):
        eng.step()
    long = Request("long", list(PROMPT), 4)
    eng.submit(long)
    trace = []
    while long.state is not State.DECODE:
        before = [len(r.output) for r in short] + [long.computed]
        eng.step()
        after = [len(r.output) for r in short] + [long.computed]
        trace.append((*(a - b for a, b in zip(after, before, strict=True)),))
        eng.check_integrity()
    eng.run([])
    eng.check_integrity()
    built.close()
    return [*short, long], trace


def _cold(model, req: Request) -> list[int]:  # noqa: ANN001
    built = _engine(model, 0)
    alone = Request(req.rid, list(req.tokens), req.max_new_tokens)
    built.engine.run([alone])
    built.close()
    return alone.output


def test_long_prefill_mid_decode_keeps_every_decode_moving(model, ckpt: Path) -> None:  # noqa: ANN001
    reqs, trace = _mid_decode(model, budget=16)
    # every step: one token for each short request, 14 = 16 - 2 prompt tokens for the long one
    assert [t[:2] for t in trace] == [(1, 1)] * len(trace)
    assert [t[2] for t in trace] == [14] * (LONG // 14) + [LONG % 14]
    hf = load_hf(ckpt)
    for req in reqs:
        assert req.output == _cold(model, req) == hf_greedy(hf, req.tokens, req.max_new_tokens)
    off, trace_off = _mid_decode(model, budget=0)  # off: the whole prompt in one step
    assert trace_off == [(1, 1, LONG)] and [r.output for r in off] == [r.output for r in reqs]


def test_budget_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="decode_step_tokens must be in"):
        EngineConfig(max_batch_tokens=64, decode_step_tokens=65)
    with pytest.raises(ValueError, match="decode_step_tokens must be in"):
        EngineConfig(decode_step_tokens=-1)
    with pytest.raises(ValueError, match="more than max_running"):
        EngineConfig(max_running=8, decode_step_tokens=8)

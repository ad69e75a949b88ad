"""The decode-latency budget (`EngineConfig.decode_step_tokens`): while requests decode, a step
carries every decode and at most the budget's rest of prefill, so a long prompt arriving
mid-decode goes through in chunks and the running requests still get one token every step;
tokens equal each request's cold run (alone, on a fresh engine) and transformers' greedy ones.
The decode-latency target (`EngineConfig.tpot_target_ms`) does the same in time, from step costs
learnt online: here the engine's clock is injected and advances by a fixed cost per planned
step, so the chunks it picks are exact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request, State
from kvstrata.engine.step_costs import StepCosts
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


def _engine(model, decode_step_tokens: int, **target: float):  # noqa: ANN001, ANN202
    cfg = EngineConfig(max_batch_tokens=256, decode_step_tokens=decode_step_tokens, **target)
    return build_engine(
        cfg, CacheConfig(page_size=PAGE, device_pages=96, host_pages=0), model=model
    )


class StepClock:
    """The engine's clock, advanced by each step's injected cost: 1/16 s for the decodes, and
    per prefill token 1/512 s beside decodes, 1/1024 s in a step of prefill alone (so the
    first estimate, from the short prompts, is too low and the scheduler must learn).
    Binary fractions: the expected chunks below are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self, eng) -> None:  # noqa: ANN001
        """One engine step, then the clock moves by what that step carried."""
        reqs = [*eng.running, *eng.waiting]  # no prefix hits here: computed grows by forwards
        before = [(r.state, r.computed) for r in reqs]
        eng.step()
        decodes = sum(1 for state, _ in before if state is State.DECODE)
        prefill = sum(
            r.computed - c
            for r, (state, c) in zip(reqs, before, strict=True)
            if state is not State.DECODE
        )
        self.now += (1 / 16 + prefill / 512) if decodes else prefill / 1024


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


def _targeted(model, target_ms: float, floor: int) -> tuple[list[Request], list[int], StepCosts]:  # noqa: ANN001
    """Two short requests decode two steps alone, then the long prompt arrives; prompt tokens
    it computed per step until it decodes (every step also gave each short request a token)."""
    built = _engine(model, 0, tpot_target_ms=target_ms, tpot_min_prefill_tokens=floor)
    eng = built.engine
    eng.clock = clock = StepClock()
    short = [Request(f"s{r}", list(toks), NEW) for r, toks in enumerate(SHORT)]
    for req in short:
        eng.submit(req)
    for _ in range(3):  # their prefill (40 tokens alone), then two all-decode steps
        clock.step(eng)
    long = Request("long", list(PROMPT), 4)
    eng.submit(long)
    chunks = []
    while long.state is not State.DECODE:
        before, outs = long.computed, [len(r.output) for r in short]
        clock.step(eng)
        assert [len(r.output) - n for r, n in zip(short, outs, strict=True)] == [1, 1]
        chunks.append(long.computed - before)
        eng.check_integrity()
    costs = dataclasses.replace(eng.scheduler.costs)  # as learnt now (the clock stops below)
    eng.run([])
    built.close()
    return [*short, long], chunks, costs


def test_tpot_target_gives_prefill_the_learnt_slack(model) -> None:  # noqa: ANN001
    reqs, chunks, costs = _targeted(model, target_ms=125.0, floor=8)
    # learnt: decode 1/16 s, prefill 1/1024 s per token (the short prompts, alone). Slack under
    # 1/8 s: 64 tokens; that step costs 1/16 + 64/512, the sample 1/512 per token moves the
    # estimate halfway each time: 3/2048 -> 42 tokens, 7/4096 -> 36, then the 8 left
    assert chunks == [64, 42, 36, 8]
    assert costs == StepCosts(decode_s=1 / 16, prefill_token_s=15 / 8192)  # the 8 not yet seen
    cold = [_cold(model, r) for r in reqs]
    assert [r.output for r in reqs] == cold
    # a target at the decode cost itself leaves no slack: the floor still moves the prompt
    floored, chunks, _ = _targeted(model, target_ms=62.5, floor=16)
    assert chunks == [16] * (LONG // 16) + [LONG % 16]
    assert [r.output for r in floored] == cold


def test_target_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="tpot_target_ms must be >= 0"):
        EngineConfig(tpot_target_ms=-1.0)
    with pytest.raises(ValueError, match="tpot_min_prefill_tokens must be in"):
        EngineConfig(tpot_min_prefill_tokens=0)

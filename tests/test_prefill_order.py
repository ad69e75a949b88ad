"""The prefill order (`EngineConfig.prefill_order`): which running prompt a step's budget goes to
first. Exact prompt tokens computed per step, on a 64-token step budget, and outputs equal to the
arrival order's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model

PAGE = 16
BUDGET = 64

CKPT = {"seed": 5, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def _engine(ckpt: Path, order: str) -> object:
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=BUDGET, prefill_order=order)
    cfg = CacheConfig(page_size=PAGE, device_pages=64).with_tiers("none")
    return build_engine(ecfg, cfg, model=load_model(ckpt))


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def _steps(eng: object, reqs: list[Request], arrive: dict[int, list[Request]]) -> list[list[int]]:
    """Step until done; `arrive[k]` is submitted before step k (1-based). Per step: each of
    `reqs`' prompt tokens computed so far."""
    steps: list[list[int]] = []
    while eng.has_work() or len(steps) + 1 in arrive:  # type: ignore[attr-defined]
        for req in arrive.get(len(steps) + 1, []):
            eng.submit(req)  # type: ignore[attr-defined]
        eng.step()  # type: ignore[attr-defined]
        eng.check_integrity()  # type: ignore[attr-defined]
        steps.append([r.computed for r in reqs])
    return steps


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        # arrival: the short prompt waits until the long one's last chunk leaves it room
        ("arrival", [[64, 0], [128, 0], [160, 20]]),
        # shortest: the short prompt goes first in the step after it arrives, the long one
        # takes the rest (and the short one decodes in step 3: its computed count moves on)
        ("shortest", [[64, 0], [108, 20], [160, 21]]),
    ],
)
def test_a_short_prompt_goes_before_a_long_one_under_shortest(
    ckpt: Path, order: str, expected: list[list[int]]
) -> None:
    """A 160-token prompt runs; a 20-token one arrives at step 2."""
    built = _engine(ckpt, order)
    long, short = Request("long", _prompt(1, 160), 3), Request("short", _prompt(2, 20), 3)
    steps = _steps(built.engine, [long, short], {1: [long], 2: [short]})  # type: ignore[attr-defined]
    assert steps[:3] == expected
    ref = _engine(ckpt, "arrival")
    again = [Request(r.rid, list(r.tokens), 3) for r in (long, short)]
    ref.engine.run(again)  # type: ignore[attr-defined]
    assert [r.output for r in (long, short)] == [r.output for r in again]
    built.close()  # type: ignore[attr-defined]
    ref.close()  # type: ignore[attr-defined]


def test_a_prompt_passed_over_goes_first_in_the_next_step(ckpt: Path) -> None:
    """A 200-token prompt and three of 64 arrive together, one token each: every short one fills
    a step alone, so the long one gets nothing in step 1; from then on a prompt passed over goes
    first in the next step (in admission order among those), before any shorter prompt."""
    built = _engine(ckpt, "shortest")
    long = Request("long", _prompt(3, 200), 1)
    shorts = [Request(f"s{i}", _prompt(10 + i, 64), 1) for i in range(3)]
    reqs = [long, *shorts]
    steps = _steps(built.engine, reqs, {1: reqs})  # type: ignore[attr-defined]
    assert steps == [
        [0, 64, 0, 0],  # fewest left first: s0; s1, s2 and long passed over
        [64, 64, 0, 0],  # passed over first, in admission order: long takes the budget
        [64, 64, 64, 0],  # s1, s2 passed over (long was served): s1
        [128, 64, 64, 0],  # long and s2 passed over: long first
        [128, 64, 64, 64],
        [192, 64, 64, 64],
        [200, 64, 64, 64],
    ]
    built.close()  # type: ignore[attr-defined]


def test_an_unknown_order_names_the_known_ones(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="unknown prefill order 'longest'; known: arrival, short"):
        _engine(ckpt, "longest")

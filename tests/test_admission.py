"""Admission drives each request's lease; a request waiting on storage does not block ready ones."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request, State
from kvstrata.model.checkpoint import load_model
from kvstrata.storage.base import StorageConfig
from tests.tiny_models import rel_err

PAGE = 16


CKPT = {"seed": 3, "max_position_embeddings": 1024}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def _engine(
    ckpt: Path, store: Path, lookahead: int, slow: float, tiers: str = "device_host_storage"
) -> object:
    # a probe's answer waits for no deadline here: the step waits until it comes
    ecfg = EngineConfig(
        model=str(ckpt), admission_lookahead=lookahead, chunk_tokens=256, probe_wait_ms=60e3
    )
    ccfg = CacheConfig(
        page_size=PAGE,
        device_pages=96,
        host_pages=96,
        storage_url=f"file://{store}",
        prefetch_policy="wait_complete",
    ).with_tiers(tiers)
    return build_engine(
        ecfg, ccfg, StorageConfig(emulate_read_s_per_page=slow), model=load_model(ckpt)
    )


def test_a_returning_turn_is_admitted_in_the_step_it_arrives(ckpt: Path, tmp_path: Path) -> None:
    """Its storage probe (the new turn's pages past the cached history) is asked before the
    step's agreement and answered with it: no forward passes between arrival and admission."""
    rng = random.Random(2)
    history = [rng.randrange(97) for _ in range(6 * PAGE + 1)]
    built = _engine(ckpt, tmp_path, 4, 0.0)
    eng = built.engine  # type: ignore[attr-defined]
    first = Request("t0", history, 4)
    eng.run([first])
    eng.drain()
    turn = history + first.output + [rng.randrange(97) for _ in range(3 * PAGE)]
    again = Request("t1", turn, 4, keep_logits=True)
    eng.submit(again)
    assert eng.step().admitted == [again]  # the probe asked pages 6-8: none stored
    assert again.hits == {"device": 6, "host": 0, "storage": 0}
    assert again.lease.probe is not None and again.lease.probe.keys == again.lease.keys[6:9]
    while eng.has_work():
        eng.step()
        eng.check_integrity()
    built.close()  # type: ignore[attr-defined]
    cold = _engine(ckpt, tmp_path, 4, 0.0, tiers="none")
    ref = Request("cold", turn, 4, keep_logits=True)
    cold.engine.run([ref])  # type: ignore[attr-defined]
    cold.close()  # type: ignore[attr-defined]
    assert again.output == ref.output
    assert all(rel_err(a, b) <= 1e-4 for a, b in zip(again.logits, ref.logits, strict=True))


@pytest.mark.parametrize("lookahead", [1, 4])
def test_ready_requests_pass_one_waiting_on_storage(
    ckpt: Path, tmp_path: Path, lookahead: int
) -> None:
    rng = random.Random(1)
    long = [rng.randrange(97) for _ in range(40 * PAGE + 1)]
    shorts = [[rng.randrange(97) for _ in range(2 * PAGE + 1)] for _ in range(3)]
    warm = _engine(ckpt, tmp_path, lookahead, 0.0)
    warm.engine.run([Request("warm", long, 1)])  # type: ignore[attr-defined]
    warm.close()  # type: ignore[attr-defined]
    built = _engine(ckpt, tmp_path, lookahead, 0.01)  # 40 pages take >= 0.4 s to read
    eng = built.engine  # type: ignore[attr-defined]
    eng.run([Request(f"s{i}", t, 1) for i, t in enumerate(shorts)])
    eng.drain()
    head = Request("long", long, 1)
    behind = [Request(f"again{i}", t, 1) for i, t in enumerate(shorts)]
    for req in (head, *behind):
        eng.submit(req)
    # step 1: the head starts its storage probe; one-token requests admitted now also finish now
    first = eng.step()
    finished = [r.rid for r in first.ended]
    admitted = [r.rid for r in first.admitted]
    done_while_head_waits = list(finished)
    assert head.state is State.WAITING and head.lease is not None
    assert head.lease.waiting_on_storage
    while eng.has_work():
        result = eng.step()
        admitted += [r.rid for r in result.admitted]
        finished += [r.rid for r in result.ended]
        assert result.failed == [] and result.finished == result.ended
        eng.check_integrity()
    assert sorted(admitted) == ["again0", "again1", "again2", "long"]  # each reported once
    assert [r.rid for r in first.admitted] == done_while_head_waits
    eng.drain()
    eng.check_integrity()
    built.close()  # type: ignore[attr-defined]
    assert head.hits == {"device": 0, "host": 0, "storage": 40}
    assert all(r.hits == {"device": 2, "host": 0, "storage": 0} for r in behind)
    if lookahead == 1:  # the old behaviour: everything waits for the head's prefetch
        assert done_while_head_waits == []
        assert finished[0] == "long"
    else:  # the device hits behind it run at once and are done before the prefetch lands
        assert done_while_head_waits == ["again0", "again1", "again2"]
        assert finished == ["again0", "again1", "again2", "long"]


@pytest.mark.parametrize(("cap", "first_step"), [(0, [64, 0]), (32, [32, 32])])
def test_the_first_prefill_takes_the_whole_step_budget_unless_capped(
    ckpt: Path, cap: int, first_step: list[int]
) -> None:
    """Two cold prompts of 96 tokens, a 64-token step budget: uncapped (the default), the first
    takes all 64 and finishes a step sooner (its TTFT), the second gets the rest; with a cap of
    32 both advance 32 a step and both finish at step 3."""
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=64, chunk_tokens=cap)
    cfg = CacheConfig(page_size=PAGE, device_pages=32).with_tiers("none")
    built = build_engine(ecfg, cfg, model=load_model(ckpt))
    eng = built.engine
    rng = random.Random(2)
    reqs = [Request(f"r{i}", [rng.randrange(97) for _ in range(96)], 1) for i in range(2)]
    for req in reqs:
        eng.submit(req)
    finished_at: dict[str, int] = {}
    steps: list[list[int]] = []
    while eng.has_work():
        done = eng.step().ended
        steps.append([r.computed for r in reqs])
        finished_at.update({r.rid: len(steps) for r in done})
        eng.check_integrity()
    assert steps[0] == first_step
    assert finished_at == ({"r0": 2, "r1": 3} if cap == 0 else {"r0": 3, "r1": 3})
    built.close()

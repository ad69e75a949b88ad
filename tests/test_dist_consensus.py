"""Step consensus on real gloo ranks (forked processes on 127.0.0.1).

One 4-rank spawn (tp=2 x cp=2) runs two scenarios back to back, to keep process start-up cheap:
A) asynchronous events finishing at random per-rank times are agreed by MIN in one collective per
   step, the decision logs agree at every step, and check-consensus exits 0;
B) an injected divergence (rank 2 skips a decision at step 5) stops every rank live with the same
   report naming step 5 and rank 2, and the offline checker names the same from the logs;
C) a config field that differs across ranks, and ranks at different steps, fail on every rank.
A second, 2-rank spawn checks that a dead rank is named instead of a silent hang.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvstrata.ranks.checker import check_logs
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.consensus import ConsensusDivergence, StepConsensus, StepMisalignment
from kvstrata.ranks.decision_log import DecisionLog
from kvstrata.ranks.group import RankContext, RankFailure, run_ranks, verify_same

torch.set_num_threads(1)

FIELDS = ("loads_done", "stores_done", "storage_hit_len")
MAX_FIELDS = ("read_failures",)
N_OPS = 40


class SlowOps:
    """A stand-in copy engine: ops finish in submission order after a random per-rank delay."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._submitted = 0
        self._done = 0
        self._cv = threading.Condition()
        threading.Thread(target=self._work, daemon=True).start()

    def submit(self) -> None:
        with self._cv:
            self._submitted += 1
            self._cv.notify()

    def completed_count(self) -> int:
        return self._done

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._done < self._submitted)
            time.sleep(self._rng.uniform(0.0, 0.006))
            self._done += 1


def _agreement(ctx: RankContext, log_dir: str) -> dict[str, Any]:
    """Scenario A: one step = submit work, agree on completions, apply exactly the agreed ones."""
    cfg = DistConfig(tp=2, cp=2, consensus_log=log_dir, consensus_check="live")
    log = DecisionLog.from_config(cfg, ctx.rank)
    sc = StepConsensus(FIELDS, MAX_FIELDS, live_check=True)
    loads, stores = SlowOps(ctx.rank * 2), SlowOps(ctx.rank * 2 + 1)
    rng = random.Random(100 + ctx.rank)
    agreed_seq, local_seq, digests = [], [], []
    step = 0
    while step < 20 or sc_done(agreed_seq) < N_OPS:
        if step < N_OPS:
            loads.submit()
            if step % 2 == 0:
                stores.submit()
        time.sleep(rng.uniform(0.0, 0.004))  # ranks reach the step at different times
        local = {
            "loads_done": loads.completed_count(),
            "stores_done": stores.completed_count(),
            "storage_hit_len": 30 - rng.randrange(3),  # each rank found a different prefix
            "read_failures": 1 if (ctx.rank == 3 and step == 7) else 0,
        }
        agreed = sc.agree(step, local, log)
        # Apply exactly the agreed events, in order (the same ids on every rank).
        done = agreed.values["loads_done"]
        log.record("apply_loads", ops=list(range(done - agreed.new["loads_done"], done)))
        log.record("hit", pages=agreed["storage_hit_len"], failed=agreed["read_failures"])
        digests.append(log.end_step(step))
        agreed_seq.append(agreed.values)
        local_seq.append(local)
        step += 1
        time.sleep(0.001)
    log.close()
    tp = _tp_group_min(ctx)
    return {
        "agreed": agreed_seq,
        "local": local_seq,
        "digests": digests,
        "per_step": sc.collectives_per_step,
        "rare": sc.rare_collectives,
        "tp_min": tp,
    }


def sc_done(agreed_seq: list[dict[str, int]]) -> int:
    return agreed_seq[-1]["loads_done"] if agreed_seq else 0


def _tp_group_min(ctx: RankContext) -> int:
    """A consensus over the tp subgroup only spans that group (ranks {0,1} and {2,3})."""
    sc = StepConsensus(("x",), group=ctx.tp_group)
    return sc.agree(0, {"x": 10 + ctx.rank}).values["x"]


def _divergence(ctx: RankContext, log_dir: str) -> dict[str, Any]:
    """Scenario B: rank 2 skips one decision at step 5; live mode stops everyone."""
    cfg = DistConfig(tp=2, cp=2, consensus_log=log_dir, inject_divergence="5:2")
    log = DecisionLog.from_config(cfg, ctx.rank)
    sc = StepConsensus(("loads_done",), live_check=True)
    applied = 0
    for step in range(12):
        try:
            sc.agree(step, {"loads_done": step}, log)
        except ConsensusDivergence as exc:
            log.close()
            div = exc.divergence
            return {"at": step, "text": str(exc), "step": div.step, "minority": div.minority}
        if not log.should_skip(step):
            applied += 1
        log.record("evict", pages=[step, step + 100])
        log.record("backup", pages=[step])
        log.end_step(step)
    return {"at": None}


def _startup_errors(ctx: RankContext) -> list[str]:
    """Scenario C: a differing config field, and ranks at different steps, fail on every rank."""
    errors = []
    verify_same("cache", {"page_size": 64, "model": "m"})  # equal everywhere: no error
    try:
        verify_same("cache", {"page_size": 32 if ctx.rank == 3 else 64, "model": "m"})
    except ValueError as exc:
        errors.append(str(exc))
    try:
        StepConsensus(("x",)).agree(1 if ctx.rank == 0 else 0, {"x": 0})
    except StepMisalignment as exc:
        errors.append(str(exc).split(":")[0])
    return errors


def _both(ctx: RankContext, dir_a: str, dir_b: str) -> tuple[Any, ...]:
    assert (ctx.tp_rank, ctx.cp_rank, ctx.pp_rank) == (ctx.rank % 2, ctx.rank // 2, 0)
    return _agreement(ctx, dir_a), _divergence(ctx, dir_b), _startup_errors(ctx)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path, Path]:
    root = tmp_path_factory.mktemp("consensus")
    dir_a, dir_b = root / "agree", root / "diverge"
    results = run_ranks(_both, DistConfig(tp=2, cp=2, timeout_s=60), (str(dir_a), str(dir_b)))
    return results, dir_a, dir_b


def test_min_agreement_one_collective_per_step(four_ranks: tuple[list[Any], Path, Path]) -> None:
    results = [r[0] for r in four_ranks[0]]
    agreed = results[0]["agreed"]
    assert agreed[-1]["loads_done"] == N_OPS
    saw_lag = False
    for res in results:
        assert res["agreed"] == agreed  # every rank applies the same events
        assert res["per_step"] == 1.0 and res["rare"] == 0
        for step, (a, local) in enumerate(zip(res["agreed"], res["local"], strict=True)):
            assert a["loads_done"] <= local["loads_done"]  # never ahead of this rank
            assert a["stores_done"] <= local["stores_done"]
            assert a["storage_hit_len"] <= local["storage_hit_len"]
            assert a["read_failures"] == (1 if step == 7 else 0)  # MAX: seen everywhere
            saw_lag |= a["loads_done"] < local["loads_done"]
            if step:
                assert a["loads_done"] >= res["agreed"][step - 1]["loads_done"]
    assert saw_lag, "random delays should make some rank finish ahead of the agreed count"
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert [r["tp_min"] for r in results] == [10, 10, 12, 12]


def test_agreeing_logs_check_clean(four_ranks: tuple[list[Any], Path, Path]) -> None:
    result = check_logs(four_ranks[1])
    steps = len(four_ranks[0][0][0]["agreed"])
    assert result.ok and result.text() == f"all 4 ranks agree over {steps} steps"


def test_injected_divergence_live_and_offline(four_ranks: tuple[list[Any], Path, Path]) -> None:
    live = [r[1] for r in four_ranks[0]]
    # Detected in the next step's collective, naming step 5 and rank 2, identically everywhere.
    assert all(r["at"] == 6 and r["step"] == 5 and r["minority"] == [2] for r in live)
    assert len({r["text"] for r in live}) == 1
    text = live[0]["text"]
    assert "diverged at step 5: rank 2 diverged from the majority (ranks 0, 1, 3)" in text
    assert 'ranks 0, 1, 3: evict {"pages":[5,105]}' in text
    assert 'rank 2: backup {"pages":[5]}' in text
    offline = check_logs(four_ranks[2]).divergence
    assert offline is not None and offline.step == 5 and offline.minority == [2]
    assert offline.text() == text


def test_config_mismatch_and_step_misalignment_fail_everywhere(
    four_ranks: tuple[list[Any], Path, Path],
) -> None:
    expected = [
        "cache.page_size differs across ranks: rank 0 has 64, rank 3 has 32",
        "ranks are at different steps",
    ]
    assert [r[2] for r in four_ranks[0]] == [expected] * 4


def _dies(ctx: RankContext) -> int:
    sc = StepConsensus(("x",))
    for step in range(50):
        if ctx.rank == 1 and step == 3:
            os._exit(3)  # a crash: no report, no teardown
        sc.agree(step, {"x": step})
    return dist.get_rank()


def test_a_dead_rank_is_named_not_a_hang() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 failed: died \(exit code 3\)"):
        run_ranks(_dies, DistConfig(tp=2, timeout_s=10), timeout_s=60)
    assert time.monotonic() - start < 30

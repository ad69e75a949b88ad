"""The engine on real gloo ranks (TP=2, PP=2, CP=2, and all three: 8 ranks) equals one rank and
recomputation, through device, host (forced demotion between turns) and storage written by another
parallel layout; CP shards the device pool and the compute; with random per-rank delays the trees
stay identical at every step; an injected divergence is named live and offline."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.feed import MultiTurn, Workload
from kvstrata.engine.request import Request
from kvstrata.ranks.checker import check_logs
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.group import RankFailure
from kvstrata.ranks.rank_engine import RankOptions, run_distributed
from tests.tiny_models import rel_err

torch.set_num_threads(1)
PAGE = 8


CKPT = {"seed": 3, "max_position_embeddings": 1024}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def chats(n_conv: int, turns: int, seed: int, lo: int = 20, hi: int = 40) -> list:
    rng = random.Random(seed)
    return [
        [[rng.randrange(5, 97) for _ in range(rng.randrange(lo, hi))] for _ in range(turns)]
        for _ in range(n_conv)
    ]


def cache_cfg(store: Path, device: int = 64, host: int = 64) -> CacheConfig:
    return CacheConfig(
        page_size=PAGE,
        device_pages=device,
        host_pages=host,
        storage_url=f"file://{store}",
        prefetch_policy="wait_complete",
    )


def serve_one_rank(
    ckpt: Path, tiers: str, store: Path, work: Workload, host: int = 64
) -> dict[str, Request]:
    """The plain single-rank engine (build_engine) over the same workload, demoting between turns."""
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=1024, chunk_tokens=1024)
    built = build_engine(ecfg, cache_cfg(store, host=host).with_tiers(tiers))
    eng, done, just = built.engine, {}, []
    while (new := work.poll(just)) is not None or eng.has_work():
        if not eng.has_work() and eng.cache is not None:
            eng.drain()
            held = eng.cache.alloc_device(eng.cache.tiers.device.num_free) or []
            eng.cache.tiers.evict_device(64)
            eng.cache.drain()
            eng.cache.free_device(held)
        for req in new or []:
            eng.submit(req)
        just = eng.step().ended
        eng.check_integrity()
        done.update((r.rid, r) for r in just)
    built.close()
    return done


def assert_logits(got: dict, ref: dict[str, Request]) -> None:
    assert got and set(got) <= set(ref)
    for rid, rows in got.items():
        assert len(rows) == len(ref[rid].logits)
        for a, b in zip(rows, ref[rid].logits, strict=True):
            assert rel_err(torch.from_numpy(a), b) <= 1e-4, rid


CONV = chats(1, 3, seed=0, lo=40, hi=60)


@pytest.fixture(scope="module")
def recompute(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Request]:
    return serve_one_rank(ckpt, "none", tmp_path_factory.mktemp("s"), MultiTurn(CONV, 4, True))


@pytest.mark.parametrize("mode", ["tp", "pp", "cp", "tp+pp+cp"])
def test_parallel_equals_one_rank_and_recompute(
    mode: str, ckpt: Path, recompute: dict[str, Request], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    # one rank writes turn 0 to storage; the parallel run must hit it (written by another layout)
    first = serve_one_rank(ckpt, "device_host_storage", store, MultiTurn([CONV[0][:1]], 4, True))
    assert_logits({k: [x.numpy() for x in r.logits] for k, r in first.items()}, recompute)
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=1024)
    opts = RankOptions(delay=2, seed=1, demote_when_idle=True, tree_digests=True)
    res = run_distributed(
        ecfg,
        cache_cfg(store),
        DistConfig(**dict.fromkeys(mode.split("+"), 2)),
        MultiTurn(CONV, 4, True),
        options=opts,
    )
    for r in res:
        assert_logits(r["logits"], recompute)
        assert r["digests"] == res[0]["digests"] and len(r["digests"]) > 10
    hits = res[0]["hits"]
    assert hits["c0t0"]["storage"] > 0  # pages written by one rank, read by several
    assert hits["c0t1"]["host"] > 0 and hits["c0t2"]["host"] > 0  # demoted between turns
    if mode == "cp":  # each rank's pool has half the slots and holds about half the pages
        total = res[0]["cached_device_pages"]
        assert total >= 16 and [r["pool_slots"] for r in res] == [32, 32]
        assert sum(r["owned_device_pages"] for r in res) == total
        assert all(abs(r["owned_device_pages"] - total / 2) <= 1 for r in res)
        # compute follows ownership: every new token ran on exactly one rank, about half each
        fed = sum(len(q.tokens) - 8 * sum(hits[q.rid].values()) + 3 for q in recompute.values())
        assert sum(r["tokens_computed"] for r in res) == fed
        assert all(r["tokens_computed"] >= fed / 3 for r in res)
    # a fresh single rank reads the parallel run's pages (turns 1, 2) from storage: same logits
    last = Request("c0t2", list(recompute["c0t2"].tokens), 4, keep_logits=True)
    again = serve_one_rank(ckpt, "device_host_storage", store, _Once(last))
    assert again["c0t2"].hits["storage"] > hits["c0t0"]["storage"]
    assert_logits({"c0t2": [x.numpy() for x in again["c0t2"].logits]}, {"c0t2": recompute["c0t2"]})


class _Once:
    """A workload of requests all sent at the first step."""

    def __init__(self, req: Request | list[Request]) -> None:
        self.reqs: list[Request] | None = req if isinstance(req, list) else [req]

    def poll(self, finished: list[Request]) -> list[Request] | None:
        out, self.reqs = self.reqs, None
        return out


def test_random_delays_keep_trees_identical(ckpt: Path, tmp_path: Path) -> None:
    """Stage-local copies and storage reads finish late at random; 200+ steps of multi-turn
    chat with the host pool too small to keep everything (storage probes and prefetches): the trees
    never differ."""
    convs = chats(2, 9, seed=4, lo=10, hi=25)
    # one rank with a roomy host pool writes every page to storage first; the 2-stage run's small
    # host pool then overflows, so later turns prefetch their older pages back from storage
    ref = serve_one_rank(
        ckpt, "device_host_storage", tmp_path / "store", MultiTurn(convs, 18), host=512
    )
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=1024)
    opts = RankOptions(delay=4, seed=7, demote_when_idle=True, tree_digests=True)
    res = run_distributed(
        ecfg,
        cache_cfg(tmp_path / "store", device=128, host=24),
        DistConfig(pp=2),
        MultiTurn(convs, 18),
        options=opts,
    )
    assert len(res[0]["digests"]) >= 200
    assert res[0]["digests"] == res[1]["digests"]
    assert res[0]["outputs"] == res[1]["outputs"] == {k: r.output for k, r in ref.items()}
    assert sum(h["storage"] for h in res[0]["hits"].values()) > 0
    assert res[0]["collectives_per_step"] == 1.0


def test_injected_divergence_named_live_and_offline(ckpt: Path, tmp_path: Path) -> None:
    """Rank 1 skips one agreed decision at step 5 (tp=2): the live digest check stops both
    ranks naming step 5 and rank 1, and the offline checker names the same from the logs."""
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=1024)
    logs = tmp_path / "logs"
    cfg = DistConfig(tp=2, consensus_check="live", inject_divergence="5:1", consensus_log=str(logs))
    with pytest.raises(RankFailure, match="diverged at step 5: .*rank 1 differs from rank 0"):
        tiers = cache_cfg(tmp_path / "s", host=64).with_tiers("device_host")
        run_distributed(ecfg, tiers, cfg, MultiTurn(CONV, 4))
    offline = check_logs(logs)
    assert offline.divergence is not None
    assert offline.divergence.step == 5 and offline.divergence.minority == [1]


def test_cp_batches_fit_the_scratch_budget(ckpt: Path, tmp_path: Path) -> None:
    """cp=2 with three prompts at once: the scheduler trims batches so both gather buffer pairs
    stay within the budget (one prompt's worth is about 77 kB here), with unchanged outputs."""
    prompts = [p[0] for p in chats(3, 1, seed=9, lo=50, hi=56)]

    def reqs() -> list[Request]:
        return [Request(f"r{i}", p, 4, keep_logits=True) for i, p in enumerate(prompts)]

    ref = serve_one_rank(ckpt, "none", tmp_path / "r", _Once(reqs()))
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=1024)
    budget = 150_000  # two prompts fit, three do not
    res = run_distributed(
        ecfg,
        cache_cfg(tmp_path / "s").with_tiers("device"),
        DistConfig(cp=2),
        reqs(),
        options=RankOptions(cp_scratch_bytes=budget),
    )
    assert all(0 < r["peak_scratch"] <= budget for r in res)
    for r in res:
        assert_logits(r["logits"], ref)

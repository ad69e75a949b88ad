"""Speculative decoding on real gloo ranks (TP=2, PP=2, CP=2), a draft model (self:3: its
acceptance here changes when restores drop the draft part; self:2's does not) and an MTP head,
each layout run twice on one store (the second run: fresh processes, a storage hit):

- greedy tokens on every rank equal one rank's without speculation;
- every request's acceptance sequence, on every rank, equals one rank's speculative run on a
  cold cache (no tiers) exactly, in both runs: after host restores (every cached page is pushed
  device -> host between turns: RankOptions.demote_when_idle) and after the second run's storage
  restores;
- every page a rank restored (its part: the target's layers it holds, and on the ranks holding
  them the draft's tail layers) equals the bytes the first run cached, bit for bit, and the
  draft's part is there (not zeros) on the ranks that hold it: the last pipeline stage, every
  cp owner, every tp rank (its heads);
- every rank's speculator names the same draft fingerprint as one rank's.

The MTP head is tests.tiny_models.save_echo_head's (mtp:random accepts nothing here)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.feed import MultiTurn, drive
from kvstrata.engine.request import Request
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.rank_engine import RankOptions, run_distributed
from tests.tiny_models import make_llama, save_echo_head

torch.set_num_threads(1)
PAGE, NEW, SPEC_TOKENS, TARGET_LAYERS = 8, 12, 3, 4
_rng = random.Random(0)
CONV = [[_rng.randrange(5, 97) for _ in range(_rng.randrange(20, 40))] for _ in range(3)]
"""One conversation's three user turns: each turn's prompt extends the previous turn's."""


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("specranks")


@pytest.fixture(scope="module")
def ckpt(tmp: Path) -> Path:
    # 2 K/V heads (one per tp rank), 4 layers (two per pp stage); self:3 = the first three
    return make_llama(tmp / "ckpt", seed=5, num_hidden_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def drafts(ckpt: Path, tmp: Path) -> dict[str, str]:
    return {"self": "self:3", "mtp": save_echo_head(ckpt, tmp / "echo.safetensors", vocab=80)}


def engine_cfg(ckpt: Path, draft: str) -> EngineConfig:
    return EngineConfig(
        model=str(ckpt), max_batch_tokens=1024, chunk_tokens=1024,
        spec_draft=draft, spec_tokens=SPEC_TOKENS, model_cache_dir=str(ckpt.parent),
    )  # fmt: skip


def one_rank(ckpt: Path, draft: str) -> tuple[dict[str, Request], str]:
    """The conversation on one in-process engine with no cache: (requests by id, the
    speculator's fingerprint)."""
    built = build_engine(engine_cfg(ckpt, draft), CacheConfig(page_size=PAGE).with_tiers("none"))
    done: dict[str, Request] = {}
    for just in drive(built.engine, MultiTurn([CONV], NEW)):
        built.engine.check_integrity()
        done.update((r.rid, r) for r in just.ended)
    spec = built.engine.spec
    built.close()
    return done, spec.fingerprint if spec is not None else ""


@pytest.fixture(scope="module")
def refs(ckpt: Path, drafts: dict[str, str]) -> dict[str, Any]:
    """One rank's tokens without speculation, and each draft's acceptance and fingerprint."""
    plain, _ = one_rank(ckpt, "")
    out: dict[str, Any] = {"tokens": {rid: r.output for rid, r in plain.items()}}
    for kind, draft in drafts.items():
        reqs, fp = one_rank(ckpt, draft)
        assert {rid: r.output for rid, r in reqs.items()} == out["tokens"]
        out[kind] = ({rid: r.spec_accepts for rid, r in reqs.items()}, fp)
        assert sum(map(sum, out[kind][0].values())) > 0, f"{kind}: nothing accepted"
    return out


def ranked(ckpt: Path, draft: str, layout: str, store: Path) -> list[dict[str, Any]]:
    """The conversation on tp x cp x pp gloo ranks with tiers device_host_storage on `store`."""
    cache = CacheConfig(
        page_size=PAGE, device_pages=64, host_pages=64, storage_url=f"file://{store}",
        prefetch_policy="wait_complete",
    )  # fmt: skip
    options = RankOptions(tree_digests=True, report_pages=True, demote_when_idle=True)
    dist = DistConfig(**dict.fromkeys(layout.split("+"), 2))
    work = MultiTurn([CONV], NEW)
    return run_distributed(
        engine_cfg(ckpt, draft),
        cache,
        dist,
        work,
        options=options,
        timeout_s=120,
    )


def draft_part(rep: dict[str, Any], page: np.ndarray) -> np.ndarray:
    """The draft's tail layers of a rank's part of a page [layers, 2, page, heads, dim] (empty
    on a rank holding none: a pipeline stage before the last)."""
    first, end = rep["part"][0]
    return page[max(first, TARGET_LAYERS) - first : end - first]


def check_pages(run: list[dict[str, Any]], cold: list[dict[int, np.ndarray]]) -> int:
    """Every page each rank of `run` restored equals that rank's `cold` bytes (key -> bytes);
    the number of those pages holding a draft part (each checked not all zeros)."""
    with_draft = 0
    for rep, ref in zip(run, cold, strict=True):
        for pages in rep["restored_pages"].values():
            for key, got in pages.items():
                assert np.array_equal(got, ref[key]), (rep["rank"], key)
                part = draft_part(rep, got)
                with_draft += part.size > 0
                assert part.size == 0 or part.any(), f"rank {rep['rank']}: empty draft part"
    return with_draft


def cold_bytes(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[dict]:
    """Per rank, the bytes the second run's restored pages must have: as the first run cached
    them for the pages turn 0 restored from storage; as the second run first cached them for the
    pages it computed itself (a prefill after a hit is not bit-equal to one over the whole
    prompt, so those pages may differ from the first run's in their last bits)."""
    out = []
    for a, b in zip(first, second, strict=True):
        from_storage = b["restored_pages"]["c0t0"]
        out.append({**b["cached_pages"], **{k: a["cached_pages"][k] for k in from_storage}})
    return out


LAYOUTS = [
    ("tp", "self"),
    ("pp", "self"),
    ("cp", "self"),
    ("pp", "mtp"),
    ("cp", "mtp"),
    pytest.param("tp+pp+cp", "self", marks=pytest.mark.slow),  # 8 ranks
    ("pp+cp", "mtp"),
]


@pytest.mark.parametrize(("layout", "kind"), LAYOUTS)
def test_speculation_on_ranks_equals_one_rank_after_every_restore(
    ckpt: Path, drafts: dict[str, str], refs: dict[str, Any], tmp: Path, layout: str, kind: str
) -> None:
    store = tmp / f"store-{layout}-{kind}"
    first = ranked(ckpt, drafts[kind], layout, store)
    second = ranked(ckpt, drafts[kind], layout, store)  # fresh ranks: turn 0 from storage
    accepts, fingerprint = refs[kind]
    for rep in [*first, *second]:
        assert rep["outputs"] == refs["tokens"], rep["rank"]
        assert rep["spec_accepts"] == accepts, rep["rank"]
        assert rep["spec_fingerprint"] == fingerprint
    hits = first[0]["hits"]
    assert hits["c0t0"]["host"] == 0 and hits["c0t1"]["host"] > 0 and hits["c0t2"]["host"] > 0
    assert second[0]["hits"]["c0t0"]["storage"] > 0
    cold = [rep["cached_pages"] for rep in first]  # each page's bytes when first cached
    assert check_pages(first, cold) > 0  # host restores
    assert (
        check_pages(second, cold_bytes(first, second)) > 0
    )  # storage restores, then device / host

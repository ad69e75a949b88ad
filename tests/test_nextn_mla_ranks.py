"""A DeepSeek-V3 checkpoint's own NextN layer as the draft on real gloo ranks (TP=2; PP=2 x
CP=2), each layout run twice on one store (the second run: fresh processes, a storage hit):

- greedy tokens and every request's acceptance sequence, on every rank, equal one rank's
  (tests.test_spec_ranks: after host restores and the second run's storage restores);
- every restored page (target latent, NextN latent, target state) equals the bytes first cached;
- TP=2: both ranks run the whole NextN layer over the whole latent page; tp rank 0 alone writes
  the units, and a fresh TP=1 engine on that store hits them and drafts as a cold run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.feed import MultiTurn, drive
from kvstrata.engine.request import Request
from tests.test_spec_ranks import (
    CONV,
    NEW,
    PAGE,
    check_pages,
    cold_bytes,
    engine_cfg,
    one_rank,
    ranked,
)

torch.set_num_threads(1)
MLA_CKPT = {"seed": 3, "num_nextn_predict_layers": 1}
"""tests/test_nextn_mla.py's tiny DeepseekV3 with a NextN layer (built once per session)."""


@pytest.fixture(scope="module")
def refs(mla_ckpt: Path) -> dict[str, Any]:
    """One rank, no cache: greedy tokens without a draft; acceptances and fingerprint with it."""
    plain, _ = one_rank(mla_ckpt, "")
    reqs, fingerprint = one_rank(mla_ckpt, "nextn")
    tokens = {rid: r.output for rid, r in plain.items()}
    assert {rid: r.output for rid, r in reqs.items()} == tokens
    accepts = {rid: r.spec_accepts for rid, r in reqs.items()}
    assert sum(map(sum, accepts.values())) > 0
    return {"tokens": tokens, "accepts": accepts, "fingerprint": fingerprint}


def one_rank_on(ckpt: Path, store: Path) -> dict[str, Request]:
    """The conversation on one in-process engine over `store` (all tiers)."""
    cache = CacheConfig(
        page_size=PAGE, device_pages=64, host_pages=64, storage_url=f"file://{store}",
        prefetch_policy="wait_complete",
    )  # fmt: skip
    built = build_engine(engine_cfg(ckpt, "nextn"), cache)
    done: dict[str, Request] = {}
    for just in drive(built.engine, MultiTurn([CONV], NEW)):
        built.engine.check_integrity()
        done.update((r.rid, r) for r in just.ended)
    built.close()
    return done


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "pp+cp"])
def test_nextn_draft_on_ranks_equals_one_rank(
    mla_ckpt: Path, refs: dict[str, Any], tmp_path: Path, layout: str
) -> None:
    store = tmp_path / "store"
    first = ranked(mla_ckpt, "nextn", layout, store)
    second = ranked(mla_ckpt, "nextn", layout, store)
    for rep in [*first, *second]:
        assert rep["outputs"] == refs["tokens"], rep["rank"]
        assert rep["spec_accepts"] == refs["accepts"], rep["rank"]
        assert rep["spec_fingerprint"] == refs["fingerprint"]
    assert second[0]["hits"]["c0t0"]["storage"] > 0
    cold = [rep["cached_pages"] for rep in first]
    assert check_pages(first, cold) > 0
    assert check_pages(second, cold_bytes(first, second)) > 0
    if layout != "tp":
        return
    assert [rep["part"][1] for rep in first] == [(0, 1), (0, 1)]  # the whole latent row
    assert first[0]["mover"]["backup_bytes"] > 0 and first[1]["mover"]["backup_bytes"] == 0
    tp1 = one_rank_on(mla_ckpt, store)  # TP=2 wrote, TP=1 reads
    assert tp1["c0t0"].hits["storage"] == (len(CONV[0]) - 1) // PAGE
    assert {rid: r.output for rid, r in tp1.items()} == refs["tokens"]
    assert {rid: r.spec_accepts for rid, r in tp1.items()} == refs["accepts"]

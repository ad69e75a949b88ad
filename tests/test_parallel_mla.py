"""Latent (MLA) pages under tensor parallelism on real gloo ranks: every tp rank computes and
holds the same latent, so each storage unit (a layer's latent rows) is written by exactly one
rank and read by all; a prefix written under tp=2 is a storage hit under tp=1 with equal logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.engine.feed import MultiTurn
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.storage.units import UnitLayout
from tests.test_dist_engine import CONV, PAGE, _Once, assert_logits, serve_one_rank
from tests.test_parallel_kv import run

torch.set_num_threads(1)
MLA_CKPT = {"seed": 5, "max_position_embeddings": 1024}
"""This module's tiny DeepseekV3 (the `mla_ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def recompute(mla_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Request]:
    return serve_one_rank(mla_ckpt, "none", tmp_path_factory.mktemp("s"), MultiTurn(CONV, 4, True))


@pytest.mark.slow
def test_tp2_writes_each_latent_unit_once_and_tp1_hits_it(
    mla_ckpt: Path, recompute: dict[str, Request], tmp_path: Path
) -> None:
    url = str(tmp_path / "storage")
    res = run(mla_ckpt, url, "tp")
    for r in res:
        assert_logits(r["logits"], recompute)  # sharded heads, replicated latent: equal logits
        assert r["part"] == ((0, 3), (0, 1))  # every rank: all layers, the whole latent row
    full = load_model(mla_ckpt).kv_shape(PAGE)
    assert full.layout == "mla"
    keys = sorted(res[0]["host_pages"])
    assert keys and sorted(res[1]["host_pages"]) == keys
    for k in keys:  # the same latent bytes on both ranks
        assert (res[0]["host_pages"][k] == res[1]["host_pages"][k]).all()
    writer, reader = res
    assert (
        writer["storage"]["units_written"] * UnitLayout(full).unit_nbytes
        == (writer["mover"]["backup_bytes"])
    )
    assert writer["mover"]["backup_bytes"] == len(keys) * full.page_nbytes
    assert reader["storage"]["units_written"] == 0 and reader["mover"]["backup_bytes"] == 0
    # a fresh tp=1 engine hits those pages from storage: logits equal recompute
    last = Request("c0t2", list(recompute["c0t2"].tokens), 4, keep_logits=True)
    again = serve_one_rank(mla_ckpt, "device_host_storage", Path(url), _Once(last))
    assert again["c0t2"].hits["storage"] >= len(keys) - 1
    assert_logits({"c0t2": [x.numpy() for x in again["c0t2"].logits]}, {"c0t2": recompute["c0t2"]})
    # and a new tp=2 run reads them on both ranks (the non-writer included)
    res2 = run(mla_ckpt, url, "tp")
    for r in res2:
        assert r["hits"]["c0t0"]["storage"] > 0
        assert_logits(r["logits"], recompute)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp", "tp+pp+cp"])
def test_cp_and_pp_over_latent_pages_equal_recompute(
    layout: str, mla_ckpt: Path, recompute: dict[str, Request], tmp_path: Path
) -> None:
    """cp=2 (owner-sharded latent pages, the double-buffered gather of their rows) and
    tp=2 x pp=2 x cp=2: logits equal recompute; every page's bytes are written exactly once
    (pp stages their layers, cp ranks their own pages, tp rank 0 alone); tp=1 then hits them."""
    url = str(tmp_path / "storage")
    res = run(mla_ckpt, url, layout)
    for r in res:
        assert_logits(r["logits"], recompute)
    full = load_model(mla_ckpt).kv_shape(PAGE)
    keys = set().union(*(r["host_pages"] for r in res))
    assert sum(r["mover"]["backup_bytes"] for r in res) == len(keys) * full.page_nbytes
    last = Request("c0t2", list(recompute["c0t2"].tokens), 4, keep_logits=True)
    again = serve_one_rank(mla_ckpt, "device_host_storage", Path(url), _Once(last))
    assert again["c0t2"].hits["storage"] >= len(keys) - 1
    assert_logits({"c0t2": [x.numpy() for x in again["c0t2"].logits]}, {"c0t2": recompute["c0t2"]})

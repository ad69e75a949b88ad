"""tp=2 ranks over a real Mooncake Store: each rank (its own client) writes only its own units of
every backed-up page; a tp=1 reader gets the pages bit-exact and hits them with equal logits.
A segment holder process keeps the objects after the ranks exit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstrata.engine.request import Request
from kvstrata.storage.units import PagePart, UnitLayout
from tests.mooncake_server import held_store
from tests.test_dist_engine import assert_logits
from tests.test_parallel_kv import CKPT, FULL, _canonical, _read, recompute, run

pytestmark = pytest.mark.slow  # a mooncake_master, a segment holder and rank processes
__all__ = ["CKPT", "recompute"]  # the parallel KV tests' checkpoint and recompute fixture


def test_tp2_ranks_write_only_their_units_and_a_tp1_reader_hits_them(
    ckpt: Path,
    recompute: dict[str, Request],
    tmp_path: Path,
) -> None:
    with held_store() as (_, url):
        check_tp2_units_then_tp1_hits(ckpt, recompute, url)


def check_tp2_units_then_tp1_hits(ckpt: Path, recompute: dict[str, Request], url: str) -> None:
    res = run(ckpt, url, "tp")
    for r in res:
        assert_logits(r["logits"], recompute)
    canon = _canonical(res)
    keys = sorted(canon)
    unit = UnitLayout(FULL).unit_nbytes
    for r in res:  # each rank wrote exactly its own heads' units of every backed-up page
        (l0, l1), (h0, h1) = r["part"]
        assert (l1 - l0, h1 - h0) == (2, 1)
        assert r["storage"]["units_written"] * unit == r["mover"]["backup_bytes"]
        assert r["mover"]["foreign_backup_bytes"] == 0
        assert r["storage"]["put_skipped"] == 0
    assert sum(r["mover"]["backup_bytes"] for r in res) == len(keys) * FULL.page_nbytes
    got = _read(url, PagePart(FULL, (0, 2), (0, 2)), keys)
    assert all(np.array_equal(g, canon[k]) for g, k in zip(got, keys, strict=True))
    one = run(ckpt, url, "")[0]  # tp=1 reader on the same store
    assert one["hits"]["c0t0"]["storage"] > 0
    assert_logits(one["logits"], recompute)

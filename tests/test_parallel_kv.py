"""Parallel KV placement on real gloo ranks: CP owner-sharded host pool (each rank's host pool holds
only its own pages), rank-local storage units in a topology-free layout (written under tp=2 x pp=2
and cp=2, read under tp=1 and back, bit-exact), no byte of other ranks' parts through rank 0,
and a rank killed mid-backup leaves no visible partial page."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.keys import key_hex
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.feed import MultiTurn
from kvstrata.engine.request import Request
from kvstrata.memory.layout import KVShape
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.group import RankFailure
from kvstrata.ranks.rank_engine import RankOptions, run_distributed
from kvstrata.storage.base import StorageConfig
from kvstrata.storage.config import storage_config
from kvstrata.storage.unit_sweep import pending_key
from kvstrata.storage.units import CRASH_EXIT_CODE, PagePart, UnitLayout, open_unit_storage
from tests.test_dist_engine import CONV, PAGE, _Once, assert_logits, serve_one_rank

torch.set_num_threads(1)
FULL = KVShape(2, 2, 16, PAGE)  # the tiny llama below: 2 layers, 2 K/V heads, head_dim 16


CKPT = {"seed": 3, "max_position_embeddings": 1024}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def recompute(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Request]:
    return serve_one_rank(ckpt, "none", tmp_path_factory.mktemp("s"), MultiTurn(CONV, 4, True))


def ccfg(url: str, host: int = 64) -> CacheConfig:
    return CacheConfig(
        page_size=PAGE,
        device_pages=64,
        host_pages=host,
        storage_url=url,
        prefetch_policy="wait_complete",
    )


def run(
    ckpt: Path, url: str, layout: str, tiers: str = "device_host_storage", **opts: object
) -> list[dict]:
    dist = DistConfig(**dict.fromkeys(layout.split("+"), 2)) if layout else DistConfig()
    ecfg = EngineConfig(model=str(ckpt), max_batch_tokens=1024)
    options = RankOptions(demote_when_idle=True, report_host_pages=True, **opts)  # type: ignore[arg-type]
    return run_distributed(
        ecfg, ccfg(url).with_tiers(tiers), dist, MultiTurn(CONV, 4, True), options=options
    )


def close_pages(a: np.ndarray, b: np.ndarray) -> bool:
    x, y = torch.from_numpy(a).view(torch.float32), torch.from_numpy(b).view(torch.float32)
    return float((x - y).abs().max()) <= 1e-4 * float(y.abs().max())


def test_cp2_each_host_pool_holds_its_own_pages(ckpt: Path, tmp_path: Path) -> None:
    """cp=2: half the host slots and bytes per rank; the two ranks' host pages are disjoint, make
    up the whole (identical) tree's host memory, and equal the cp=1 run's pages, page by page."""
    one = run(ckpt, str(tmp_path / "a"), "", tiers="device_host")[0]
    two = run(ckpt, str(tmp_path / "b"), "cp", tiers="device_host")
    assert [r["host_slots"] for r in two] == [32, 32] and one["host_slots"] == 64
    assert [2 * r["host_bytes"] for r in two] == [one["host_bytes"]] * 2
    total = two[0]["cached_host_pages"]
    assert total >= 16 and two[1]["cached_host_pages"] == total
    mine = [set(r["host_pages"]) for r in two]
    assert not mine[0] & mine[1] and len(mine[0]) + len(mine[1]) == total
    assert [r["owned_host_pages"] for r in two] == [len(m) for m in mine]
    assert all(abs(len(m) - total / 2) <= 2 for m in mine)  # round robin: balanced
    assert mine[0] | mine[1] == set(one["host_pages"])
    for r in two:
        for key, page in r["host_pages"].items():
            assert close_pages(page, one["host_pages"][key]), key
    for r in two:
        assert r["mover"]["foreign_backup_bytes"] == 0


def _canonical(reports: list[dict]) -> dict[int, np.ndarray]:
    """Assemble full pages from every rank's reported parts (its layers x heads)."""
    out: dict[int, torch.Tensor] = {}
    for r in reports:
        (l0, l1), (h0, h1) = r["part"]
        part = PagePart(FULL, (l0, l1), (h0, h1))
        for key, page in r["host_pages"].items():
            full = out.setdefault(key, torch.zeros(2, 2, PAGE, 2, 16))
            full[l0:l1, :, :, h0:h1] = part.view(page, full=False)
    return {k: t.reshape(-1).view(torch.uint8).numpy() for k, t in out.items()}


def _read(url: str, part: PagePart, keys: list[int]) -> list[np.ndarray]:
    store = open_unit_storage(url, part, StorageConfig(), commit_on_put=False)
    try:
        assert store.exists_prefix(keys) == len(keys)
        out = [np.zeros(part.shape.page_nbytes, np.uint8) for _ in keys]
        assert store.get(keys, out) == len(keys)
        store.check_integrity()
        return out
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp+pp", "cp"])
def test_layouts_write_units_read_under_tp1_bit_exact(
    layout: str, ckpt: Path, recompute: dict[str, Request], tmp_path: Path
) -> None:
    """Write under tp=2 x pp=2 (or cp=2): each rank writes exactly its own units (rank 0 none of
    the others'); a tp=1 reader gets bit-exact pages and equal logits, and back: pages written
    at tp=1 read under every tp=2 x pp=2 part bit-exact."""
    url = str(tmp_path / "storage")
    res = run(ckpt, url, layout)
    for r in res:
        assert_logits(r["logits"], recompute)
    canon = _canonical(res)
    keys = sorted(canon)
    # every backed-up page written once, in units, each rank only its part of its own pages
    unit = UnitLayout(FULL).unit_nbytes
    for r in res:
        (l0, l1), (h0, h1) = r["part"]
        assert r["storage"]["unit_bytes_written"] == r["mover"]["backup_bytes"]
        assert r["storage"]["units_written"] * unit == r["mover"]["backup_bytes"]
        assert r["storage"]["units_written"] % ((l1 - l0) * (h1 - h0)) == 0
        assert r["mover"]["foreign_backup_bytes"] == 0
    assert sum(r["mover"]["backup_bytes"] for r in res) == len(keys) * FULL.page_nbytes
    got = _read(url, PagePart(FULL, (0, 2), (0, 2)), keys)
    assert all(np.array_equal(g, canon[k]) for g, k in zip(got, keys, strict=True))
    # a fresh tp=1 engine hits those pages from storage: logits equal recompute
    last = Request("c0t2", list(recompute["c0t2"].tokens), 4, keep_logits=True)
    again = serve_one_rank(ckpt, "device_host_storage", Path(url), _Once(last))
    assert again["c0t2"].hits["storage"] >= len(keys) - 1
    assert_logits({"c0t2": [x.numpy() for x in again["c0t2"].logits]}, {"c0t2": recompute["c0t2"]})
    if layout != "tp+pp":
        return
    # and back: tp=1 writes, every tp=2 x pp=2 part reads its cut bit-exact
    url1 = str(tmp_path / "storage-tp1")
    one = run(ckpt, url1, "")[0]
    keys1 = sorted(one["host_pages"])
    for layers in ((0, 1), (1, 2)):
        for heads in ((0, 1), (1, 2)):
            part = PagePart(FULL, layers, heads)
            got = _read(url1, part, keys1)
            for g, k in zip(got, keys1, strict=True):
                ref = part.view(one["host_pages"][k], full=True)[
                    slice(*layers), :, :, slice(*heads)
                ]
                assert torch.equal(part.view(g, full=False), ref)
    res2 = run(ckpt, url1, "tp+pp")
    assert res2[0]["hits"]["c0t0"]["storage"] > 0
    for r in res2:
        assert_logits(r["logits"], recompute)


def test_unit_layout_keys_and_alignment() -> None:
    """Unit keys depend on the page key and ranges only; a part cutting a unit is refused."""
    lay = UnitLayout(FULL)
    assert lay.unit_nbytes == 2 * PAGE * 16 * 4
    part = PagePart(FULL, (0, 2), (1, 2))
    assert lay.blocks(part) == [((0, 1), (1, 2)), ((1, 2), (1, 2))]
    assert lay.unit_key(7, ((0, 1), (1, 2))) != lay.unit_key(7, ((1, 2), (1, 2)))
    assert lay.unit_key(7, ((0, 1), (1, 2))) == UnitLayout(FULL).unit_key(7, ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="not aligned"):
        UnitLayout(FULL, layer_block=2).blocks(PagePart(FULL, (0, 1), (0, 2)))
    with pytest.raises(ValueError, match="head_block"):
        UnitLayout(FULL, head_block=3)


def test_whole_page_store_of_the_older_layout_is_refused(tmp_path: Path) -> None:
    """A directory of whole-page files (the layout before units) is refused by name, never
    silently missed; the same directory once it holds units opens again."""
    from kvstrata.storage.file_store import FileStore

    old = FileStore(str(tmp_path / "old"), FULL.page_nbytes)
    assert old.put([5], [np.ones(FULL.page_nbytes, np.uint8)]) == 1
    old.close()
    whole = PagePart(FULL, (0, 2), (0, 2))
    with pytest.raises(ValueError, match=r"old.*whole-page files .*kvstrata-unit-v1"):
        open_unit_storage(str(tmp_path / "old"), whole)
    assert not (tmp_path / "old" / "commits").exists()  # refused before creating anything
    fresh = open_unit_storage(str(tmp_path / "new"), whole)
    assert fresh.put([5], [np.ones(FULL.page_nbytes, np.uint8)]) == 1
    fresh.close()
    again = open_unit_storage(str(tmp_path / "new"), whole)  # units + commits/: accepted
    assert again.exists_prefix([5]) == 1
    again.close()


def test_redis_units_round_trip_across_parts(tmp_path: Path) -> None:
    """The same unit layout over a real redis-server: two half-head writers, one full reader;
    nothing is visible before the commit."""
    import redis

    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        cfg = storage_config(redis_key_prefix="units:", stale_unit_s=900)
        halves = [PagePart(FULL, (0, 2), (h, h + 1)) for h in (0, 1)]
        rng = np.random.default_rng(0)
        full = [rng.integers(0, 255, FULL.page_nbytes, dtype=np.uint8) for _ in range(3)]
        keys = [11, 12, 13]
        for i, part in enumerate(halves):
            w = open_unit_storage(server.url, part, cfg, commit_on_put=False)
            cut = [
                part.view(p, full=True)[:, :, :, i : i + 1].contiguous().view(-1).view(torch.uint8)
                for p in full
            ]
            assert w.put(keys, [c.numpy() for c in cut]) == 3
            assert w.exists_prefix(keys) == 0  # units in, no commit yet
            if i == 1:
                assert w.commit(keys[:2]) == 2
            w.close()
        r = open_unit_storage(server.url, PagePart(FULL, (0, 2), (0, 2)), cfg)
        assert r.exists_prefix(keys) == 2
        # a committed page's units keep no expiry; the uncommitted one's expire (killed backup)
        client = redis.Redis.from_url(server.url)
        ttl = [[client.ttl(f"units:{key_hex(u)}") for u in r.all_unit_keys(k)] for k in keys]
        client.close()
        assert ttl[0] == ttl[1] == [-1] * 4
        assert all(0 < t <= cfg.redis.stale_unit_s for t in ttl[2]), ttl[2]
        out = [np.zeros(FULL.page_nbytes, np.uint8) for _ in keys]
        assert r.get(keys, out) == 3  # the units are there; visibility is the probe's answer
        assert all(np.array_equal(a, b) for a, b in zip(out, full, strict=True))
        r.check_integrity()
        r.close()
    finally:
        server.stop()


@pytest.mark.slow
def test_rank_killed_mid_backup_leaves_no_visible_partial_page(
    ckpt: Path, recompute: dict[str, Request], tmp_path: Path
) -> None:
    """tp=2: rank 1 dies after writing some units. Every page with a commit marker has all its
    units; some page has units without a marker (the kill was mid-backup); the next run (tp=1)
    hits exactly the committed prefix and its logits equal recompute."""
    url = str(tmp_path / "storage")
    full = run(ckpt, str(tmp_path / "ref"), "tp")
    total_units = full[1]["storage"]["units_written"]  # rank 1's units over the whole run
    assert total_units >= 10
    with pytest.raises(RankFailure, match=f"rank 1 failed: died \\(exit code {CRASH_EXIT_CODE}"):
        run(ckpt, url, "tp", crash_rank=1, crash_after_units=total_units - 3)
    keys = sorted(set(full[0]["host_pages"]))
    whole = open_unit_storage(url, PagePart(FULL, (0, 2), (0, 2)), commit_on_put=False)
    lay = whole.layout
    committed = [k for k in keys if whole.commits.exists_prefix([lay.commit_key(k)])]
    present = {k: sum(whole.units.exists_prefix([u]) for u in whole._unit_keys(k)) for k in keys}
    assert committed, "no backup was agreed before the kill"
    assert all(present[k] == 4 for k in committed)  # a visible page is whole
    partial = [k for k in keys if k not in committed and present[k]]
    assert partial, "the kill did not land mid-backup"
    # the next run: a fresh single rank serving the last turn hits the committed prefix only
    last = Request("c0t2", list(recompute["c0t2"].tokens), 4, keep_logits=True)
    visible = [k for k in keys if k in committed]
    whole.close()
    shutil.copytree(url, tmp_path / "after-kill")  # as the kill left it (the run below writes)
    _sweep_removes_exactly_the_uncommitted(tmp_path / "after-kill", tmp_path / "swept", visible)
    again = serve_one_rank(ckpt, "device_host_storage", Path(url), _Once(last))
    left = open_unit_storage(str(tmp_path / "after-kill"), PagePart(FULL, (0, 2), (0, 2)))
    lease = again["c0t2"].lease
    lead = left.exists_prefix(lease.keys[: lease.match_pages])  # the pages it may hit
    left.close()
    assert lead > 0 and again["c0t2"].hits["storage"] == lead <= len(visible)
    assert_logits({"c0t2": [x.numpy() for x in again["c0t2"].logits]}, {"c0t2": recompute["c0t2"]})


def _unit_files(root: Path) -> int:
    return sum(1 for d in root.iterdir() if len(d.name) == 2 for _ in d.glob("*.kvp"))


def _sweep_removes_exactly_the_uncommitted(src: Path, root: Path, committed: list[int]) -> None:
    """Once the killed backup's pending records are older than stale_unit_s, opening the store
    removes every unit of an uncommitted page and nothing else; a fresh uncommitted page (a
    backup that may still be in progress) stays."""
    shutil.copytree(src, root)
    before = _unit_files(root)
    assert before > 4 * len(committed)  # the kill left uncommitted units
    cfg = storage_config(stale_tmp_s=1.0, stale_unit_s=60)
    whole = PagePart(FULL, (0, 2), (0, 2))
    live = open_unit_storage(str(root), whole, cfg, commit_on_put=False)  # nothing stale yet
    assert live.stats()["units_swept"] == 0 and _unit_files(root) == before
    fresh = np.zeros(FULL.page_nbytes, np.uint8)
    assert live.put([7], [fresh]) == 1  # in progress: written now, not committed
    live.close()
    old, live_record = time.time() - 120, f"{key_hex(pending_key(7))}.kvp"
    for f in (root / "pending").rglob("*.kvp"):
        if f.name != live_record:  # the killed run's records: two minutes old
            os.utime(f, (old, old))
    swept = open_unit_storage(str(root), whole, cfg, commit_on_put=False)
    assert swept.stats()["units_swept"] == before - 4 * len(committed)
    assert _unit_files(root) == 4 * len(committed) + 4  # committed pages + the fresh one
    out = [np.empty(FULL.page_nbytes, np.uint8) for _ in committed]
    assert swept.get(committed, out) == len(committed)
    assert swept.exists_prefix(committed) == len(committed)
    assert swept.units.exists_prefix(swept.all_unit_keys(7)) == 4  # the live backup's units
    assert swept.exists_prefix([7]) == 0
    assert [f.name for f in (root / "pending").rglob("*.kvp")] == [live_record]
    swept.check_integrity()
    swept.close()


@pytest.mark.slow
def test_bench_parallel_quick_reports_the_goal_keys() -> None:
    """The benchmark's exact quantities (bytes, not timings): half the host bytes per rank at
    cp=2, every backup byte written once and by its own rank, none foreign to rank 0."""
    from kvstrata.bench.parallel import SHAPE, bench_parallel

    rep = bench_parallel(True)
    assert rep["host_bytes_per_rank_ratio_cp2"] == 0.5
    assert rep["rank0_foreign_backup_bytes"] == 0
    half = rep["backup_pages"] * SHAPE.page_nbytes // 2
    assert rep["backup_bytes_per_rank_tp2"] == rep["backup_bytes_per_rank_cp2"] == [half, half]
    for key in ("digest_overhead", "backup_gbps_tp1", "backup_gbps_tp2"):
        assert isinstance(rep[key], float)
    assert [o["tokens"] for o in rep["cache_overhead"]] == [8192, 32768]

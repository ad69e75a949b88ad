"""`kvstrata bench sglang`: our store inside SGLang HiCache against SGLang's own `file` backend.

Both sides get the same pages of one real SGLang host pool (CPU, bf16, 64-token pages), called as
SGLang's cache controller calls each: ours through the `dynamic` backend with interface_v1
(batch_set_v1 / batch_get_v1 on host indices), theirs (HiCacheFile) through the generic path
(get_data_page + batch_set; batch_get into flat pages + set_from_flat_data_page). Rounds
alternate between the sides; the ratios are ours / theirs measured in this one run. Both write
under the same temp directory (the page cache serves the reads of both).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvstrata.bench.registry import BENCHES

LAYERS, HEADS, DIM, PAGE = 8, 4, 64, 64  # 512 KiB bf16 pages


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _sides(root: str, pool: Any) -> dict[str, Any]:
    from kvstrata.integrations.sglang_harness import attach, ours, storage_config

    theirs = attach("file", storage_config("bench", {"file_storage_path": f"{root}/sg"}), pool)
    return {"ours": ours(f"file://{root}/ours", pool, model="bench"), "sglang_file": theirs}


def _calls(store: Any, zero_copy: bool, pool: Any) -> dict[str, Callable[..., object]]:
    """The controller's backup, prefetch and probe calls for one side."""

    def backup(keys: list[str], slots: Any) -> object:
        if zero_copy:
            return all(store.batch_set_v1(keys, slots, None))
        pages = [pool.get_data_page(s, flat=True) for s in slots[::PAGE].tolist()]
        return store.batch_set(keys, pages)

    def prefetch(keys: list[str], slots: Any) -> object:
        if zero_copy:
            return store.batch_get_v1(keys, slots, None)
        got = store.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for s, page in zip(slots[::PAGE].tolist(), got, strict=True):
            pool.set_from_flat_data_page(s, page)
        return got

    return {"backup": backup, "prefetch": prefetch, "probe": lambda k: store.batch_exists(k)}


def run_sglang_bench(quick: bool, base_dir: str) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kvstrata.integrations.sglang_harness import host_pool

    pages, rounds = (32, 3) if quick else (128, 5)
    pool = host_pool(LAYERS, HEADS, DIM, PAGE, pages * PAGE, dtype=torch.bfloat16)
    slots, dst = pool.alloc(pages * PAGE), pool.alloc(pages * PAGE)
    pool.kv_buffer.view(torch.int16).random_(-(2**15), 2**15 - 1)
    page_nbytes = pool.get_data_page(0, flat=True).numel() * 2
    root = tempfile.mkdtemp(prefix="kvstrata-bench-sglang-", dir=base_dir)
    times: dict[str, dict[str, float]] = {}
    try:
        sides = _sides(root, pool)
        calls = {n: _calls(s, n == "ours", pool) for n, s in sides.items()}
        for r in range(rounds):  # a fresh set of keys per round: every backup writes
            keys = get_storage_hash_str(list(range(r, r + pages * PAGE)), None, page_size=PAGE)
            for name, c in calls.items():
                t = times.setdefault(name, {"backup": 0.0, "prefetch": 0.0, "probe": 0.0})
                t["backup"] += _timed(lambda c=c, k=keys: c["backup"](k, slots))
                t["prefetch"] += _timed(lambda c=c, k=keys: c["prefetch"](k, dst))
                t["probe"] += _timed(lambda c=c, k=keys: c["probe"](k))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = rounds * pages * page_nbytes
    gbps = {
        n: {op: nbytes / t[op] / 1e9 for op in ("backup", "prefetch")} for n, t in times.items()
    }
    probe_us = {n: t["probe"] / rounds / pages * 1e6 for n, t in times.items()}
    return {
        "page_nbytes": page_nbytes,
        "pages_per_round": pages,
        "rounds": rounds,
        "ours_backup_gbps": gbps["ours"]["backup"],
        "ours_prefetch_gbps": gbps["ours"]["prefetch"],
        "sglang_file_backup_gbps": gbps["sglang_file"]["backup"],
        "sglang_file_prefetch_gbps": gbps["sglang_file"]["prefetch"],
        "backup_ratio": gbps["ours"]["backup"] / gbps["sglang_file"]["backup"],
        "prefetch_ratio": gbps["ours"]["prefetch"] / gbps["sglang_file"]["prefetch"],
        "ours_probe_us_per_page": probe_us["ours"],
        "sglang_file_probe_us_per_page": probe_us["sglang_file"],
    }


@BENCHES.register("sglang")
def bench_sglang(quick: bool) -> dict[str, Any]:
    """Our store as SGLang's HiCache storage tier vs SGLang's own file backend, same calls and
    pages."""
    try:
        import sglang  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "bench sglang needs the sglang package: bash scripts/setup_sglang.sh, then "
            "PYTHONPATH=.venv/sglang-extra .venv/bin/kvstrata bench sglang"
        ) from None
    return run_sglang_bench(quick, tempfile.gettempdir())

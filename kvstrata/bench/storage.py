"""`kvstrata bench storage`: file backend put/get vs plain sequential file I/O of the same bytes;
mooncake and redis beside it vs their own clients (kvstrata.bench.storage_net).

Ours: `FileStore.put` / `FileStore.get` in batches of `BATCH` pages (one file per page, header +
xxh3-64 checksum, temp file + rename on write, checksum verify + mtime touch on read).
Baseline: the same page buffers written one after another into one file in the same directory
(one write call per page, same fsync setting) and read back with readinto into the same output
buffers. Both sides run against the page cache (dropping it needs root), so this compares like
with like: the cost of our per-page files, headers and checksums over raw I/O. The two sides
alternate batch by batch, so on a shared, busy machine both see the same load and dirty-page
throttling; times are summed over all rounds.
Ratios are baseline_time / our_time (1.0 = as fast as raw I/O; goal >= 0.7).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstrata.bench.registry import BENCHES
from kvstrata.bench.storage_sealed import sealed_rows
from kvstrata.storage.config import FileStoreConfig
from kvstrata.storage.file_store import FileStore

GIB = 1 << 30
BATCH = 64  # pages per put/get call, like a backup or prefetch batch
POOL_PAGES = 32  # distinct source pages (random bytes), cycled so 1 GiB needs little RAM
# 2 MiB = one 64-token fp16 page of Llama-3.2-1B (16 layers x K,V x 64 x 8 heads x 64 dim x 2 B);
# 256 KiB = a small-model page, where the fixed per-file cost weighs most.
PAGE_SIZES = (2 * 1024 * 1024, 256 * 1024)


def _pages(page_nbytes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, page_nbytes, dtype=np.uint8) for _ in range(POOL_PAGES)]


class _Clock:
    """Wall and CPU seconds summed per side; CPU time is steadier on a shared, busy machine."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.turns = 0

    def run(self, side: str, fn: Callable[[], object]) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        self.wall[side] = self.wall.get(side, 0.0) + time.perf_counter() - t0
        self.cpu[side] = self.cpu.get(side, 0.0) + time.process_time() - c0

    def alternate(self, steps: dict[str, Callable[[], object]]) -> None:
        """Run both sides of one batch; who goes first alternates (same conditions for both)."""
        items = list(steps.items())
        for side, fn in items if self.turns % 2 == 0 else items[::-1]:
            self.run(side, fn)
        self.turns += 1


def _batches(n_pages: int) -> list[range]:
    return [range(lo, min(lo + BATCH, n_pages)) for lo in range(0, n_pages, BATCH)]


def _put_round(
    clock: _Clock, store: FileStore, flat: str, src: list[np.ndarray], n: int, fsync: bool
) -> None:
    """Write all pages: ours (one file each) and the baseline (one file) batch by batch."""

    def ours(ids: range) -> None:
        stored = store.put([i + 1 for i in ids], [src[i % POOL_PAGES] for i in ids])
        assert stored == len(ids), "bench put lost pages"

    def base(ids: range) -> None:
        for i in ids:
            os.write(fd, src[i % POOL_PAGES])

    fd = os.open(flat, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for ids in _batches(n):
            clock.alternate(
                {"base_put": lambda ids=ids: base(ids), "ours_put": lambda ids=ids: ours(ids)}
            )
        if fsync:
            clock.run("base_put", lambda: os.fsync(fd))  # ours fsyncs every page file inside put
    finally:
        os.close(fd)


def _get_round(
    clock: _Clock, store: FileStore, flat: str, src: list[np.ndarray], out: list[np.ndarray], n: int
) -> None:
    """Read all pages back into the same `BATCH` output buffers, ours and baseline alternating."""

    def ours(ids: range) -> None:
        got = store.get([i + 1 for i in ids], out[: len(ids)])
        assert got == len(ids), "bench get missed pages"

    def base(ids: range) -> None:
        for j in range(len(ids)):
            f.readinto(out[j])

    with open(flat, "rb", buffering=0) as f:
        for ids in _batches(n):
            clock.alternate(
                {"ours_get": lambda ids=ids: ours(ids), "base_get": lambda ids=ids: base(ids)}
            )
    store.get([n], out[:1])  # page n - 1 (keys are ids + 1): the bytes must be right
    assert np.array_equal(out[0], src[(n - 1) % POOL_PAGES]), "bench get read wrong bytes"


def _one_size(root: str, page_nbytes: int, total: int, repeats: int, fsync: bool) -> dict[str, Any]:
    """`repeats` rounds of put then get on fresh files; times summed over all rounds."""
    n_pages = max(BATCH, total // page_nbytes)
    src = _pages(page_nbytes)
    flat = os.path.join(root, "baseline.bin")
    store_dir = os.path.join(root, "store")
    clock = _Clock()
    out = [np.ones(page_nbytes, np.uint8) for _ in range(BATCH)]  # touched: no page faults timed
    for _ in range(repeats):
        shutil.rmtree(store_dir, ignore_errors=True)
        if os.path.exists(flat):
            os.unlink(flat)  # a fresh file each round, like our fresh page files
        store = FileStore(store_dir, page_nbytes, FileStoreConfig(fsync=fsync))
        _put_round(clock, store, flat, src, n_pages, fsync)
        _get_round(clock, store, flat, src, out, n_pages)
        store.close()
    nbytes = n_pages * page_nbytes * repeats
    w, c = clock.wall, clock.cpu
    return {
        "page_nbytes": page_nbytes,
        "pages": n_pages,
        "put_ratio": w["base_put"] / w["ours_put"],
        "get_ratio": w["base_get"] / w["ours_get"],
        "put_ratio_cpu": c["base_put"] / max(c["ours_put"], 1e-9),
        "get_ratio_cpu": c["base_get"] / max(c["ours_get"], 1e-9),
        **{f"{k}_gbps": nbytes / v / 1e9 for k, v in sorted(w.items())},
    }


def file_create_us(base_dir: str, n: int = 200) -> float:
    """Mean cost of creating one empty file under base_dir (the fixed per-page cost of a put)."""
    d = tempfile.mkdtemp(prefix="kvstrata-create-", dir=base_dir)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            os.close(os.open(os.path.join(d, str(i)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_storage_bench(quick: bool, base_dir: str) -> dict[str, Any]:
    """The storage bench with its data under `base_dir` (removed afterwards)."""
    total = GIB // 8 if quick else GIB
    fsync = False
    root = tempfile.mkdtemp(prefix="kvstrata-bench-storage-", dir=base_dir)
    try:
        sizes = [_one_size(root, p, total, 5 if quick else 3, fsync) for p in PAGE_SIZES]
        create_us = file_create_us(root)
        sealed = sealed_rows(root, total // 8)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    main = sizes[0]
    return {
        "dir": base_dir,
        "total_bytes": total,
        "fsync": fsync,
        "page_nbytes": main["page_nbytes"],
        "put_ratio": main["put_ratio"],
        "get_ratio": main["get_ratio"],
        "put_ratio_cpu": main["put_ratio_cpu"],
        "get_ratio_cpu": main["get_ratio_cpu"],
        "put_gbps": main["ours_put_gbps"],
        "get_gbps": main["ours_get_gbps"],
        "baseline_write_gbps": main["base_put_gbps"],
        "baseline_read_gbps": main["base_get_gbps"],
        "file_create_us": create_us,
        "by_page_size": sizes,
        "sealed": sealed,  # --storage-key-file: MAC'd / encrypted units vs plain (ratios)
    }


@BENCHES.register("storage")
def bench_storage(quick: bool) -> dict[str, Any]:
    """File backend put/get of 1 GiB (quick: 128 MiB) vs plain sequential I/O of the same bytes;
    mooncake and redis put/get of 512 MiB (quick: 128 MiB) of 2 MiB pages vs a plain loop of
    their own clients; probe latency of 1,000 keys on each; and the tree's metadata per cached
    page (1M pages; quick: 100k)."""
    from kvstrata.bench.radix import metadata_bytes_per_page
    from kvstrata.bench.storage_net import NET_KEYS, bench_mooncake, bench_redis, file_probe_ms

    report = run_storage_bench(quick, tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="kvstrata-bench-probe-")
    try:
        report["file_probe_ms"] = file_probe_ms(root)["probe_ms"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, bench in (("mooncake", bench_mooncake), ("redis", bench_redis)):
        net = bench(quick)
        report[name] = net
        for key in NET_KEYS:
            if key in net:
                report[f"{name}_{key}"] = net[key]
        if "skipped" in net:
            report[f"{name}_skipped"] = net["skipped"]
    report["metadata_bytes_per_page"] = metadata_bytes_per_page(100_000 if quick else 1_000_000)
    return report

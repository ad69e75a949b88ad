"""Topology-free storage layout: a page is stored as units of (layer block x K/V-head block).

Canonical page  # [num_layers, 2, page_size, kv_heads, head_dim]
A rank of a tp x pp layout holds one *part* of it, layers [l0, l1) and heads [h0, h1)
    part page  # [l1-l0, 2, page_size, h1-h0, head_dim]
Storage never sees the part: it holds *units*, one per (layer block, head block) of fixed sizes
from the model (UnitLayout; default 1 layer x 1 head, so every tp dividing the heads and every pp
split is aligned), each under a key derived from the page key and the unit's ranges:
    unit key   = xxh3_128("kvstrata-unit-v1" | page key | l0 l1 h0 h1)
    commit key = xxh3_128("kvstrata-commit-v1" | page key | num_layers kv_heads blocks)
No rank number, world size or tp/pp/cp degree enters a key, so a page written under tp=2 x pp=2
is read unit by unit under tp=1 (or any aligned layout), each rank reading only its units.

Visibility: a page is visible (exists_prefix) only once its *commit marker* is stored, in a
separate small-value store next to the units (file: DIR/commits, redis and mooncake: key
prefix + "commit:").
The marker is written after every unit of the page is in: at once by a single rank
(commit_on_put), or under several ranks by one rank once the step consensus agreed that every
rank wrote its units (TensorMover.release). A rank killed mid-write leaves units without a marker:
never visible, overwritten by the next write of the same page, and removed once stale
(kvstrata.storage.unit_sweep: a pending record per page on file, an expiry on redis; Mooncake
evicts them under memory pressure like any object).
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvstrata.kv_shape import KVShape
from kvstrata.storage.base import (
    HEADER_NBYTES,
    PutReport,
    StorageBackend,
    StorageConfig,
    exists_runs_beside_io,
    open_storage,
    put_report,
    reads_run_together,
    register_host_memory,
    url_scheme,
)
from kvstrata.storage.file_dirs import parse_file_url, refuse_whole_page_dir
from kvstrata.storage.file_store import FileStore
from kvstrata.storage.mooncake_url import mooncake_sibling_url
from kvstrata.storage.redis_store import RedisStore
from kvstrata.storage.sealed import SealedStore
from kvstrata.storage.sealed_mark import SealedMark, refuse_keyless
from kvstrata.storage.sealer import SEAL_OVERHEAD, Sealer, read_key_file
from kvstrata.storage.unit_sweep import FilePending, RedisExpiry

UNIT_TAG = b"kvstrata-unit-v1"
COMMIT_TAG = b"kvstrata-commit-v1"
MARKER_NBYTES = 16
CRASH_EXIT_CODE = 86  # testing: exit code of a rank killed mid-backup (crash_after_units)


def _same(key: int) -> int:
    return key


@dataclass(frozen=True)
class PagePart:
    """Which layers and K/V heads of the canonical page one rank holds."""

    full: KVShape
    layers: tuple[int, int]
    heads: tuple[int, int]

    def __post_init__(self) -> None:
        (l0, l1), (h0, h1) = self.layers, self.heads
        if not 0 <= l0 < l1 <= self.full.num_layers:
            raise ValueError(f"layers {self.layers} outside [0, {self.full.num_layers}]")
        if not 0 <= h0 < h1 <= self.full.num_kv_heads:
            raise ValueError(f"heads {self.heads} outside [0, {self.full.num_kv_heads}]")

    @property
    def shape(self) -> KVShape:
        """The rank-local page shape (what its pools hold)."""
        f, (l0, l1), (h0, h1) = self.full, self.layers, self.heads
        return dataclasses.replace(f, num_layers=l1 - l0, num_kv_heads=h1 - h0)

    def view(self, page: np.ndarray | torch.Tensor, full: bool) -> torch.Tensor:
        """A uint8 buffer as a [layers, 2, page, heads, dim] tensor (shares memory)."""
        s = self.full if full else self.shape
        t = torch.from_numpy(page) if isinstance(page, np.ndarray) else page
        shape = (s.num_layers, 2, s.page_size, s.num_kv_heads, s.head_dim)
        return t.view(torch.uint8).view(s.torch_dtype).view(shape)


Block = tuple[tuple[int, int], tuple[int, int]]  # ((l0, l1), (h0, h1)) of one unit


@dataclass(frozen=True)
class UnitLayout:
    """The fixed storage granularity of one model's pages (never the parallel layout's)."""

    full: KVShape
    layer_block: int = 1
    head_block: int = 1

    def __post_init__(self) -> None:
        for name, total in (
            ("layer_block", self.full.num_layers),
            ("head_block", self.full.num_kv_heads),
        ):
            b = getattr(self, name)
            if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or total % b:
                raise ValueError(f"{name} must be a positive divisor of {total}, got {b!r}")

    @property
    def unit_nbytes(self) -> int:
        f = self.full
        return self.layer_block * 2 * f.page_size * self.head_block * f.head_dim * f.itemsize

    def blocks(self, part: PagePart) -> list[Block]:
        """The units that make up `part`, layer-major; ValueError if it cuts a unit."""
        (l0, l1), (h0, h1) = part.layers, part.heads
        lb, hb = self.layer_block, self.head_block
        if l0 % lb or l1 % lb or h0 % hb or h1 % hb:
            raise ValueError(
                f"part layers {part.layers} heads {part.heads} is not aligned to the storage "
                f"units of {lb} layer(s) x {hb} head(s)"
            )
        return [((a, a + lb), (h, h + hb)) for a in range(l0, l1, lb) for h in range(h0, h1, hb)]

    def unit_key(self, key: int, block: Block) -> int:
        (l0, l1), (h0, h1) = block
        raw = UNIT_TAG + key.to_bytes(16, "little") + struct.pack("<4I", l0, l1, h0, h1)
        return xxhash.xxh3_128_intdigest(raw)

    def commit_key(self, key: int) -> int:
        f = self.full
        dims = struct.pack("<4I", f.num_layers, f.num_kv_heads, self.layer_block, self.head_block)
        return xxhash.xxh3_128_intdigest(COMMIT_TAG + key.to_bytes(16, "little") + dims)

    def marker(self) -> np.ndarray:
        f = self.full
        dims = (f.num_layers, f.num_kv_heads, self.layer_block, self.head_block)
        return np.frombuffer(struct.pack("<4I", *dims), np.uint8).copy()


PENDING_CAP_SHARE = 16
"""1/16 of a file store's cap is the pending records' (a few in-flight pages, and the fan-out
directories they leave, which a capped store removes once empty)."""


def split_file_cap(
    url: str, config: StorageConfig, unit_file_nbytes: int, units_per_page: int
) -> tuple[StorageConfig, StorageConfig, int]:
    """(units, commits configs, pending cap) sharing a file store's max_bytes: the pending
    records take a fixed share; units and commits the rest by what a page takes on disk: its
    unit files and its marker file, each a whole number of blocks (the cap is one budget for
    the directory, not one per sub-store)."""
    cap = config.file.max_bytes
    if not cap:
        return config, config, 0
    pending = max(1, cap // PENDING_CAP_SHARE)
    budget = cap - pending
    root = parse_file_url(url)
    block = os.statvfs(root if root.is_dir() else root.parent).f_frsize or 4096
    unit_disk = units_per_page * -(-(HEADER_NBYTES + unit_file_nbytes) // block) * block
    marker_disk = -(-(HEADER_NBYTES + MARKER_NBYTES) // block) * block
    commits = budget * marker_disk // (unit_disk + marker_disk)
    return (
        _with_file(config, max_bytes=max(1, budget - commits)),
        _with_file(config, max_bytes=max(1, commits)),
        pending,
    )


def _with_file(config: StorageConfig, **changes: Any) -> StorageConfig:
    """`config` with its file backend's options `changes`."""
    return dataclasses.replace(config, file=dataclasses.replace(config.file, **changes))


def _page_read_latency(
    units: StorageConfig, commits: StorageConfig, units_per_page: int
) -> tuple[StorageConfig, StorageConfig]:
    """The emulated read time is per page (`emulate_read_s_per_page`): the unit store reads
    `units_per_page` units for each of this rank's part pages, so each unit waits that share;
    commit markers are not payload and wait nothing."""
    per_page = units.emulate_read_s_per_page
    return (
        dataclasses.replace(units, emulate_read_s_per_page=per_page / units_per_page),
        dataclasses.replace(commits, emulate_read_s_per_page=0.0),
    )


def commit_store_url(url: str, config: StorageConfig) -> tuple[str, StorageConfig]:
    """Where the commit markers of the unit store at `url` live (a sibling namespace)."""
    scheme = url_scheme(url)
    if scheme == "file":
        return str(parse_file_url(url) / "commits"), config
    if scheme == "mooncake":
        return mooncake_sibling_url(url, "commit:"), config
    prefix = config.redis.redis_key_prefix + "commit:"
    return url, dataclasses.replace(
        config, redis=dataclasses.replace(config.redis, redis_key_prefix=prefix)
    )


class UnitStorage:
    """A StorageBackend over one rank's part of every page, stored as layout-free units."""

    @property
    def concurrent_exists(self) -> bool:
        """A probe asks the commit store, beside the units' reads and the markers' writes."""
        return exists_runs_beside_io(self.commits) and exists_runs_beside_io(self.units)

    @property
    def concurrent_reads(self) -> bool:
        """A get reads units (into the pages, or into buffers of its own) and counts them under
        the lock; a probe reads commit markers."""
        return reads_run_together(self.units) and reads_run_together(self.commits)

    def __init__(
        self,
        units: StorageBackend,
        commits: StorageBackend,
        layout: UnitLayout,
        part: PagePart,
        commit_on_put: bool,
        crash_after_units: int = 0,
        pending: FilePending | RedisExpiry | None = None,
        name: Callable[[int], int] | None = None,
    ) -> None:
        if units.page_nbytes != layout.unit_nbytes or commits.page_nbytes != MARKER_NBYTES:
            raise ValueError("unit / commit stores were opened with the wrong value sizes")
        if layout.full != part.full:
            raise ValueError(f"layout is for {layout.full}, part for {part.full}")
        self.units, self.commits, self.layout, self.part = units, commits, layout, part
        self.commit_on_put = commit_on_put
        self.crash_after_units = crash_after_units
        self.blocks = layout.blocks(part)
        whole = PagePart(part.full, (0, part.full.num_layers), (0, part.full.num_kv_heads))
        self.all_blocks = layout.blocks(whole)  # every rank's units of a page
        self._one_unit = len(self.blocks) == 1  # a unit is this part's whole page: no cut, no paste
        self.pending = pending
        self.name = name or _same
        """page key -> its name in the store (a sealed store's are keyed: Sealer.name); every
        unit key, commit key and pending record derives from the name, never the page key."""
        self.page_nbytes = part.shape.page_nbytes
        self._marker = layout.marker()
        self.mark: SealedMark | None = None  # set where the store is sealed
        self.backend = ""  # the URL scheme it was opened with (metrics' label)
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("units_written", "unit_bytes_written", "units_read", "unit_bytes_read", "commits"), 0
        )

    # ---- cutting a part page into units and back ------------------------------------------
    def _grid(self, page: np.ndarray) -> np.ndarray:
        """uint8 page bytes as [layers, 2, page_size, heads, dim * itemsize] (a view)."""
        s = self.part.shape
        return page.reshape(s.num_layers, 2, s.page_size, s.num_kv_heads, -1)

    def _cut(self, page: np.ndarray) -> list[np.ndarray]:
        g, (l0, _), (h0, _) = self._grid(page), self.part.layers, self.part.heads
        return [
            np.ascontiguousarray(g[a - l0 : b - l0, :, :, c - h0 : d - h0]).reshape(-1)
            for (a, b), (c, d) in self.blocks
        ]

    def _paste(self, units: Sequence[np.ndarray], page: np.ndarray) -> None:
        g, (l0, _), (h0, _) = self._grid(page), self.part.layers, self.part.heads
        for ((a, b), (c, d)), u in zip(self.blocks, units, strict=True):
            dst = g[a - l0 : b - l0, :, :, c - h0 : d - h0]
            dst[...] = u.reshape(dst.shape)

    def _unit_keys(self, key: int) -> list[int]:
        """This rank's unit keys of page `key`."""
        return self._units_named(self.name(key), self.blocks)

    def all_unit_keys(self, key: int) -> list[int]:
        """The keys of every unit of page `key` (all ranks' blocks)."""
        return self._units_named(self.name(key), self.all_blocks)

    def _units_named(self, name: int, blocks: list[Block]) -> list[int]:
        return [self.layout.unit_key(name, b) for b in blocks]

    def _commit_keys(self, keys: Sequence[int]) -> list[int]:
        return [self.layout.commit_key(self.name(k)) for k in keys]

    # ---- StorageBackend ---------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[int]) -> int:
        """Leading pages whose commit marker is in (all their units were written)."""
        return self.commits.exists_prefix(self._commit_keys(keys))

    def register_buffer(self, array: np.ndarray) -> bool:
        """Host memory for zero-copy unit transfers (used where a unit is a whole part page)."""
        return register_host_memory(self.units, array)

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        """Read this rank's units of `keys` into out[i] (part pages); leading pages read OK."""
        per = len(self.blocks)
        ukeys = [u for k in keys for u in self._unit_keys(k)]
        if self._one_unit:  # straight into the pages (zero-copy where they are registered)
            n = self.units.get(ukeys, [o.reshape(-1).view(np.uint8) for o in out])
        else:
            bufs = [np.empty(self.layout.unit_nbytes, np.uint8) for _ in ukeys]
            n = self.units.get(ukeys, bufs) // per
            for i in range(n):
                self._paste(bufs[i * per : (i + 1) * per], out[i])
        self._count(units_read=n * per, unit_bytes_read=n * per * self.layout.unit_nbytes)
        return n

    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        """Write this rank's units of each page; count of pages whose units are all in."""
        return self.put_report(keys, pages).stored

    def put_report(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> PutReport:
        """As put, with the unit bytes actually written (units found stored and kept: none)."""
        stored: list[int] = []
        names = [self.name(k) for k in keys]
        if self.mark is not None:
            self.mark.refresh()
        if self.pending is not None:
            self.pending.maybe_sweep(self._is_committed, self._drop_units)
            self.pending.wrote(names)  # before any unit: a kill leaves a record to sweep
        written = 0
        for key, name, page in zip(keys, names, pages, strict=True):
            ukeys, ubufs = self._units_named(name, self.blocks), self._cut(page)
            self._maybe_crash(ukeys, ubufs)
            report = put_report(self.units, ukeys, ubufs)
            written += report.written_bytes
            if report.stored == len(ukeys):
                stored.append(key)
            self._count(
                units_written=report.written_bytes // self.layout.unit_nbytes,
                unit_bytes_written=report.written_bytes,
            )
        if self.commit_on_put and stored:
            self.commit(stored)
        return PutReport(len(stored), written)

    def commit(self, keys: Sequence[int]) -> int:
        """Make pages visible: every rank's units of them are in (the caller knows)."""
        n = self.commits.put(self._commit_keys(keys), [self._marker] * len(keys))
        self._count(commits=n)
        if self.pending is not None and n == len(keys):
            names = [self.name(k) for k in keys]
            self.pending.committed(names, lambda name: self._units_named(name, self.all_blocks))
        return n

    def sweep(self) -> int:
        """Remove the units of stale uncommitted pages now (see unit_sweep); units removed."""
        if self.pending is None:
            return 0
        return self.pending.sweep(self._is_committed, self._drop_units)

    def _is_committed(self, name: int) -> bool:
        return self.commits.exists_prefix([self.layout.commit_key(name)]) == 1

    def _drop_units(self, names: list[int]) -> int:
        return self.units.delete([u for n in names for u in self._units_named(n, self.all_blocks)])

    def delete(self, keys: Sequence[int]) -> int:
        """Hide pages (drop their markers) and drop this rank's units of them."""
        n = self.commits.delete(self._commit_keys(keys))
        self.units.delete([u for k in keys for u in self._unit_keys(k)])
        return n

    def _maybe_crash(self, ukeys: list[int], ubufs: list[np.ndarray]) -> None:
        """Testing: die like a killed rank after `crash_after_units` units, mid-page."""
        left = self.crash_after_units - self.counts["units_written"]
        if self.crash_after_units and left <= len(ukeys):
            self.units.put(ukeys[:left], ubufs[:left])
            os._exit(CRASH_EXIT_CODE)

    def _count(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self.counts[k] += v

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            own = dict(self.counts)
        swept = self.pending.counts if self.pending is not None else {}
        return {**self.units.stats(), **own, **swept}

    def check_integrity(self) -> None:
        assert all(v >= 0 for v in self.counts.values()), self.counts
        self.units.check_integrity()
        self.commits.check_integrity()

    def close(self) -> None:
        self.units.close()
        self.commits.close()
        if isinstance(self.pending, FilePending):
            self.pending.store.close()


def open_unit_storage(
    url: str,
    part: PagePart,
    config: StorageConfig | None = None,
    commit_on_put: bool = True,
    layout: UnitLayout | None = None,
    crash_after_units: int = 0,
) -> UnitStorage:
    """The unit store at `url` (file, redis, mooncake or any registered backend) seen through
    `part` of every page; with config.key_file every unit value is sealed (kvstrata.storage.sealed)."""
    config = config or StorageConfig()
    layout = layout or UnitLayout(part.full)
    redis_units = url_scheme(url) != "file"
    if not redis_units:
        refuse_whole_page_dir(url)  # before the commits store opens (it creates commits/)
    ucfg = config
    if redis_units:  # a unit outlives a backup by the sweep's bound, then expires
        ttl = dataclasses.replace(config.redis, redis_ttl_s=config.redis.stale_unit_s)
        ucfg = dataclasses.replace(config, redis=ttl)
    sealer = Sealer(read_key_file(config.key_file), config.encrypt) if config.key_file else None
    unit_value = layout.unit_nbytes + (SEAL_OVERHEAD if sealer else 0)
    curl, ccfg = commit_store_url(url, config)
    pending_cap = 0
    if not redis_units:
        per_page = len(
            layout.blocks(
                PagePart(part.full, (0, part.full.num_layers), (0, part.full.num_kv_heads))
            )
        )
        ucfg, ccfg, pending_cap = split_file_cap(url, config, unit_value, per_page)
    ucfg, ccfg = _page_read_latency(ucfg, ccfg, len(layout.blocks(part)))
    raw_units = open_storage(url, unit_value, ucfg)
    commits = open_storage(curl, MARKER_NBYTES, ccfg)
    pending: FilePending | RedisExpiry | None = None
    if isinstance(raw_units, FileStore):
        fcfg = config.file
        pcfg = dataclasses.replace(fcfg, touch_on_read=False, max_bytes=pending_cap)  # mtime=age
        store = FileStore(str(parse_file_url(url) / "pending"), 16, pcfg)
        pending = FilePending(store, fcfg.stale_unit_s, fcfg.rescan_interval_s)
    elif isinstance(raw_units, RedisStore):
        pending = RedisExpiry(raw_units, config.redis.redis_ttl_s)
    units: StorageBackend = (
        SealedStore(raw_units, sealer, config.file.seal_check_thread) if sealer else raw_units
    )
    name = sealer.name if sealer else None
    out = UnitStorage(units, commits, layout, part, commit_on_put, crash_after_units, pending, name)
    out.backend = url_scheme(url)
    try:
        if sealer is None:
            refuse_keyless(commits, url)
        else:
            out.mark = SealedMark(commits)
            out.mark.refresh()
    except ValueError:
        out.close()
        raise
    out.sweep()  # at open: what killed backups left
    return out

"""Rank-free storage over rank-local parts of pages, and the mover that keeps it so.

Canonical page (what L3 stores, whatever the parallel layout that wrote it): the single-rank host
page, all layers and all K/V heads  # [num_layers, 2, page_size, kv_heads, head_dim]
A rank's host and device pools hold one *part* of every page: layers [l0, l1) (its pipeline
stage) and heads [h0, h1) (its tensor-parallel slice)  # [l1-l0, 2, page_size, h1-h0, head_dim]
Context parallel does not cut pages: each page lives whole on its owner in L1, and L2 is
replicated over the cp group (a store gathers the owners' pages to every cp rank, so a later
load can put a page on whichever rank owns its new device id).

Chosen canonical-layout rule ("gather before write, cut on read"):
- L3 writes (backup): at submission, on every rank in the same order, the parts of the pages are
  gathered to global rank 0 (one gather_object over the world), which assembles the canonical
  pages and is the only rank that writes them. The others report the backup done at once; the
  step consensus (MIN) applies it when rank 0's write finished.
- L3 reads (probe, prefetch): every rank reads the canonical page and keeps its part.
So storage keys carry no rank and a page written under tp=2, pp=2 or cp=2 is a hit under tp=1.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvstrata.cache.ops import BACKUP, LOAD, STORE, TransferOp
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool, HostPool
from kvstrata.memory.transfer import TensorMover
from kvstrata.parallel.cp_gather import CPOwnership
from kvstrata.storage.base import StorageBackend


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
        return KVShape(l1 - l0, h1 - h0, f.head_dim, f.page_size, f.dtype)

    @property
    def is_full(self) -> bool:
        return self.shape == self.full

    def view(self, page: np.ndarray | torch.Tensor, full: bool) -> torch.Tensor:
        """A uint8 buffer as a [layers, 2, page, heads, dim] tensor (shares memory)."""
        s = self.full if full else self.shape
        t = torch.from_numpy(page) if isinstance(page, np.ndarray) else page
        shape = (s.num_layers, 2, s.page_size, s.num_kv_heads, s.head_dim)
        return t.view(torch.uint8).view(s.torch_dtype).view(shape)

    def cut(self, canonical: torch.Tensor) -> torch.Tensor:
        """This rank's part of a canonical page tensor  # [l1-l0, 2, page, h1-h0, dim]"""
        (l0, l1), (h0, h1) = self.layers, self.heads
        return canonical[l0:l1, :, :, h0:h1]


class PartStorage:
    """A StorageBackend over the canonical store that reads and writes one rank's parts."""

    def __init__(self, inner: StorageBackend, part: PagePart, writer: bool) -> None:
        if inner.page_nbytes != part.full.page_nbytes:
            raise ValueError(
                f"inner.page_nbytes {inner.page_nbytes} != canonical {part.full.page_nbytes}"
            )
        self.inner, self.part, self.writer = inner, part, writer
        self.page_nbytes = part.shape.page_nbytes
        self.staged: dict[int, np.ndarray] = {}  # writer: key -> canonical bytes to put
        self._lock = threading.Lock()

    def stage(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> None:
        with self._lock:
            self.staged.update(zip(keys, pages, strict=True))

    def exists_prefix(self, keys: Sequence[int]) -> int:
        return self.inner.exists_prefix(keys)

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        if self.part.is_full:
            return self.inner.get(keys, out)
        bufs = [np.empty(self.part.full.page_nbytes, np.uint8) for _ in keys]
        n = self.inner.get(keys, bufs)
        for buf, dst in zip(bufs[:n], out[:n], strict=True):
            self.part.view(dst, full=False).copy_(self.part.cut(self.part.view(buf, full=True)))
        return n

    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        if not self.writer:
            return len(keys)  # rank 0 writes the canonical page; the MIN waits for it
        if self.part.is_full:
            return self.inner.put(keys, pages)
        with self._lock:
            canonical = [self.staged.pop(k) for k in keys]
        return self.inner.put(keys, canonical)

    def delete(self, keys: Sequence[int]) -> int:
        return self.inner.delete(keys) if self.writer else 0

    def stats(self) -> dict[str, int | float]:
        return self.inner.stats()

    def check_integrity(self) -> None:
        assert self.writer or not self.staged, "only the writer stages pages"
        self.inner.check_integrity()

    def close(self) -> None:
        self.inner.close()


class DistMover(TensorMover):
    """TensorMover for one rank of a tp x cp x pp layout, with optional injected delays.

    delay = (max_polls, seed): each op looks unfinished for a random 0..max_polls polls on this
    rank (copies, storage reads and writes alike), as if this rank's transfers were late.
    """

    def __init__(
        self,
        device: DevicePool,
        host: HostPool | None,
        storage: PartStorage | None,
        cp_group: Any = None,
        delay: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(device, host, storage)  # type: ignore[arg-type]
        self.part_storage = storage
        self.own = CPOwnership(device.n_shards)
        self.cp_group = cp_group
        self._done: dict[int, int] = {}  # ops finished at submission (replicated cp stores)
        self._wait: dict[int, int] = {}
        self._rng = random.Random(delay[1]) if delay else None
        self._max_delay = delay[0] if delay else 0

    def submit(self, op: TransferOp) -> None:
        if op.kind == BACKUP and self.part_storage and not self.part_storage.part.is_full:
            self._stage_backup(op)
        if self.own.cp > 1 and op.kind == STORE:
            self._replicated_store(op)
            return
        if self.own.cp > 1 and op.kind == LOAD:
            self._owned_load(op)
            return
        super().submit(op)

    def poll(self, op: TransferOp) -> int | None:
        if self._rng is not None:
            left = self._wait.setdefault(id(op), self._rng.randint(0, self._max_delay))
            if left > 0:
                self._wait[id(op)] = left - 1
                return None
        if id(op) in self._done:
            return self._done[id(op)]
        return super().poll(op)

    def release(self, op: TransferOp) -> None:
        self._done.pop(id(op), None)
        self._wait.pop(id(op), None)
        super().release(op)

    # ---- the collectives (run at submission: every rank submits the same ops in order) ------
    def _stage_backup(self, op: TransferOp) -> None:
        """Gather the pages' parts to global rank 0, which stages the canonical pages."""
        assert self.host is not None and self.part_storage is not None
        part = self.part_storage.part
        mine = self.host.data[op.src].clone()  # [n, l1-l0, 2, page, h1-h0, dim]
        parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((part.layers, part.heads, mine), parts, dst=0)
        if parts is None:
            return
        f = part.full
        canon = torch.empty(
            (len(op.src), f.num_layers, 2, f.page_size, f.num_kv_heads, f.head_dim),
            dtype=f.torch_dtype,
        )
        for (l0, l1), (h0, h1), t in parts:
            canon[:, l0:l1, :, :, h0:h1] = t
        pages = [canon[i].reshape(-1).view(torch.uint8).numpy() for i in range(len(op.src))]
        self.part_storage.stage(op.keys, pages)

    def _replicated_store(self, op: TransferOp) -> None:
        """L1 -> L2 under cp: each owner contributes its pages; every rank's L2 gets them all."""
        assert self.host is not None
        pos, slots = self.own.owned(op.src, self.device.rank)
        mine = self.device.data[:, :, slots].permute(2, 0, 1, 3, 4, 5).clone()  # [n_own, L, 2, ...]
        got: list[Any] = [None] * self.own.cp
        dist.all_gather_object(got, (pos, mine), group=self.cp_group)
        for pos_r, pages in got:
            if pos_r:
                self.host.data[[op.dst[i] for i in pos_r]] = pages
        self._done[id(op)] = op.pages

    def _owned_load(self, op: TransferOp) -> None:
        """L2 -> L1 under cp: each rank copies only the pages it owns (layer by layer)."""
        assert self.copies is not None
        pos, _ = self.own.owned(op.dst, self.device.rank)
        op.handle = self.copies.load([op.src[i] for i in pos], [op.dst[i] for i in pos])

"""A byte-moving PageMover over numpy arrays, for exercising the cache manager's data flow.

Each page's "bytes" are one int64 (the page key's low bits), so a test can check that every page
id the tree hands out holds exactly the page it names, after any sequence of moves.
"""

from __future__ import annotations

import random

import numpy as np

from kvstrata.cache.chain import PageChain
from kvstrata.cache.config import CacheConfig
from kvstrata.cache.hicache import HiCache
from kvstrata.cache.lease import Lease
from kvstrata.cache.ops import BACKUP, LOAD, PREFETCH, PROBE, STORE, TransferOp
from kvstrata.memory.allocator import PageAllocator

MASK = (1 << 62) - 1


class ArrayMover:
    """Moves page contents between device/host arrays and a dict store, after random delays."""

    def __init__(
        self, device_pages: int, host_pages: int, max_delay: int = 0, seed: int = 0
    ) -> None:
        self.device = np.zeros(device_pages, dtype=np.int64)
        self.host = np.zeros(max(host_pages, 1), dtype=np.int64)
        self.storage: dict[int, int] = {}
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.wait: dict[int, int] = {}
        self.done: dict[int, int] = {}

    def submit(self, op: TransferOp) -> None:
        self.wait[id(op)] = self.rng.randint(0, self.max_delay)

    def cancel(self, op: TransferOp) -> None:
        self.wait[id(op)] = 0

    def wait_answered(self, op: TransferOp, timeout_s: float) -> None:
        """Ops finish as they are polled here: nothing to wait for."""

    def release(self, op: TransferOp) -> None:
        self.done.pop(id(op))

    def poll(self, op: TransferOp) -> int | None:
        if id(op) in self.done:
            return self.done[id(op)]
        if self.wait[id(op)] > 0:
            self.wait[id(op)] -= 1
            return None
        del self.wait[id(op)]
        self.done[id(op)] = res = self._run(op)
        return res

    def _run(self, op: TransferOp) -> int:
        if op.kind == LOAD:
            self.device[op.dst] = self.host[op.src]
        elif op.kind == STORE:
            self.host[op.dst] = self.device[op.src]
        elif op.kind == BACKUP:
            for k, h in zip(op.keys, op.src, strict=True):
                self.storage[k] = int(self.host[h])
        elif op.kind in (PROBE, PREFETCH):
            n = 0
            while n < len(op.keys) and op.keys[n] in self.storage:
                if op.kind == PREFETCH:
                    self.host[op.dst[n]] = self.storage[op.keys[n]]
                n += 1
            return n
        return op.pages


def make_cache(
    device: int = 16,
    host: int = 32,
    storage: bool = True,
    max_delay: int = 0,
    seed: int = 0,
    **cfg: object,
) -> tuple[HiCache, ArrayMover]:
    config = CacheConfig(
        page_size=4,
        device_pages=device,
        host_pages=host,
        storage_url="file:///unused" if storage else "",
        **cfg,
    )  # type: ignore[arg-type]
    mover = ArrayMover(device, host, max_delay, seed)
    cache = HiCache(
        config,
        PageAllocator(device),
        PageAllocator(host) if host else None,
        mover,
        has_storage=storage,
        page_nbytes=8,
    )
    return cache, mover


def content(key: int) -> int:
    return key & MASK


def serve(
    cache: HiCache, mover: ArrayMover, keys: list[int] | PageChain, max_steps: int = 1000
) -> tuple[int, int, int]:
    """One request through every tier through its lease; returns (device, host, storage) hit pages.

    The request is `keys` full pages (a key list, or a PageChain with token bytes) plus one
    token (so every page may hit). Checks that every page the cache hands back holds that
    page's content.
    """
    page = cache.config.page_size
    chain = keys
    if isinstance(keys, PageChain):  # its keys, hashed apart (the lease's chain stays lazy)
        keys = PageChain(keys.seed, page, keys.data, [], keys.width).keys_upto(keys.pages)
    lease = Lease(cache, chain, len(keys) * page + 1, len(keys), page)
    for _ in range(max_steps):
        if lease.advance(0.0, can_schedule=False):
            break
        cache.step()
        cache.check_integrity()
    else:
        raise TimeoutError(f"lease still {lease.state.value} after {max_steps} steps")
    if not lease.admit():  # device memory full of locked pages: nothing is served
        lease.release()
        return 0, 0, 0
    for _ in range(max_steps):
        if lease.load is None or lease.load.agreed is not None:
            break
        cache.step()
        cache.check_integrity()
    hit = lease.page_table[: lease.hits.pages]
    assert [int(x) for x in mover.device[hit]] == [content(k) for k in keys[: len(hit)]]
    new = lease.page_table[len(hit) :]
    mover.device[new] = [content(k) for k in keys[len(hit) :]]
    lease.commit(len(keys) * page)
    lease.release()
    h = lease.hits
    return h.device, h.host, h.storage

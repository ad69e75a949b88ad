"""Real KV bytes through every tier: device -> host -> storage -> (fresh cache) storage -> host
-> device, bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.hicache import HiCache
from kvstrata.cache.keys import Namespace, page_keys
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool, HostPool
from kvstrata.memory.transfer import TensorMover
from kvstrata.storage.base import open_storage

torch.set_num_threads(1)
SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4)
NS = Namespace(model_fingerprint="bytes-test", page_size=4)


def make(store: Path, device: int = 8, host: int = 8) -> tuple[HiCache, DevicePool, TensorMover]:
    pool, hostp = DevicePool(SHAPE, device), HostPool(SHAPE, host)
    mover = TensorMover(pool, hostp, open_storage(f"file://{store}", SHAPE.page_nbytes))
    cfg = CacheConfig(
        page_size=4, device_pages=device, host_pages=host, storage_url=f"file://{store}"
    )
    return (
        HiCache(
            cfg,
            pool.allocator,
            hostp.allocator,
            mover,
            has_storage=True,
            page_nbytes=SHAPE.page_nbytes,
        ),
        pool,
        mover,
    )


def pages_of(pool: DevicePool, ids: list[int]) -> torch.Tensor:
    return pool.data[:, :, ids].clone()  # [layers, 2, pages, page, heads, dim]


def wait(cache: HiCache, op) -> None:  # noqa: ANN001
    for _ in range(10_000):
        if op.agreed is not None:
            return
        cache.step()
        cache.check_integrity()
    raise TimeoutError(op.kind)


def test_bytes_roundtrip_every_tier(tmp_path: Path) -> None:
    cache, pool, mover = make(tmp_path)
    keys = page_keys(list(range(24)), NS)  # 6 pages
    ids = cache.alloc_device(6)
    assert ids is not None
    pool.data[:, :, ids] = torch.randn(SHAPE.num_layers, 2, 6, 4, 2, 8)
    original = pages_of(pool, ids)
    cache.insert(keys, ids)
    cache.drain()  # write-through to host memory, then backup to storage
    cache.check_integrity()
    assert cache.counters.pages_moved["host->storage"] == 6
    # one rank's share is every page, whole: all of it written, nothing foreign, committed on put
    want = {"backup_bytes": 6 * SHAPE.page_nbytes, "foreign_backup_bytes": 0, "commits": 0}
    assert mover.stats() == want
    mover.close()

    fresh, pool2, mover2 = make(tmp_path)  # a new cache sharing the store
    m = fresh.match(keys)
    assert m.pages == 0
    fresh.lock(m.last_node)
    probe = fresh.start_probe(keys)
    wait(fresh, probe)
    assert probe.agreed == 6
    op = fresh.start_prefetch(keys, m.last_node)
    wait(fresh, op)
    fresh.unlock(m.last_node)
    m = fresh.match(keys)
    assert m.host_pages == 6
    fresh.lock(m.last_node)
    load = fresh.load_host(m)
    assert load is not None
    load.handle.wait()
    assert torch.equal(pages_of(pool2, load.dst), original)
    wait(fresh, load)
    fresh.unlock(m.last_node)
    fresh.check_integrity()
    mover2.close()


def test_other_namespace_never_hits_storage(tmp_path: Path) -> None:
    cache, pool, mover = make(tmp_path)
    keys = page_keys(list(range(16)), NS)
    cache.insert(keys, cache.alloc_device(4))  # type: ignore[arg-type]
    cache.drain()
    for ns in (
        Namespace(model_fingerprint="bytes-test", page_size=4, tenant_salt="other"),
        Namespace(model_fingerprint="another-model", page_size=4),
        Namespace(model_fingerprint="bytes-test", page_size=4, kv_dtype="float16"),
    ):
        other = page_keys(list(range(16)), ns)
        assert cache.match(other).pages == 0
        probe = cache.start_probe(other)
        wait(cache, probe)
        assert probe.agreed == 0
    mover.close()


def test_bad_cache_config_names_the_parameter() -> None:
    with pytest.raises(ValueError, match="page_size"):
        CacheConfig(page_size=0)
    with pytest.raises(ValueError, match="device_pages"):
        CacheConfig(device_pages=-1)
    with pytest.raises(ValueError, match="host_pages"):
        CacheConfig(host_pages=-5)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_cache_named(eviction="fifo-ish")
    with pytest.raises(ValueError, match="unknown write policy"):
        make_cache_named(write_policy="sometimes")


def make_cache_named(**cfg: object) -> HiCache:
    from kvstrata.cache.movers import KeySetMover
    from kvstrata.memory.allocator import PageAllocator

    return HiCache(
        CacheConfig(device_pages=8, host_pages=0, **cfg), PageAllocator(8), None, KeySetMover()
    )  # type: ignore[arg-type]

"""kvstrata storage inside SGLang HiCache, against the real sglang package (CPU host pools).

Run in its own process by tests/test_sglang_storage.py: importing sglang patches transformers
(sglang.srt.utils.hf_transformers_patches), which must not leak into the other test files of a
pytest worker.

The backend is built by SGLang's own factory from the `dynamic` extra config and called as its
cache controller calls it (page hashes from get_storage_hash_str, batch_exists per batch,
batch_get_v1 / batch_set_v1 with the host indices of whole pages). Every test runs over each URL
of BACKENDS; a new backend joins by adding a (name, factory) entry there and a bit flipper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvstrata.integrations.sglang_harness import attach, host_pool, ours, storage_config
from tests.redis_server import RedisServer

PAGE = 4
LAYERS, HEADS, DIM = 2, 2, 16


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


def _file_url(tmp: Path, _redis: Callable[[], str]) -> str:
    return f"file://{tmp / 'storage'}"


def _redis_db(tmp: Path, redis_url: Callable[[], str]) -> str:
    url = redis_url()
    redis.Redis.from_url(url).flushdb()
    return url


BACKENDS = {"file": _file_url, "redis": _redis_db}  # name -> (tmp dir, redis url) -> store URL


def _flip_file(url: str) -> None:
    """Flip one payload bit of one stored page file (never the header's 40 bytes)."""
    root = Path(url.removeprefix("file://"))
    page = sorted(p for p in root.rglob("*.kvp") if "commits" not in p.parts)[0]
    data = bytearray(page.read_bytes())
    data[40 + 7] ^= 0x10
    page.write_bytes(bytes(data))


def _flip_redis(url: str) -> None:
    client = redis.Redis.from_url(url)
    name = sorted(client.keys("kvstrata:*"))[0]
    value = bytearray(client.get(name))
    value[40 + 7] ^= 0x10
    client.set(name, bytes(value))


FLIPPERS = {"file": _flip_file, "redis": _flip_redis}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    name = request.param
    url = BACKENDS[name](tmp_path, lambda: request.getfixturevalue("redis_url"))
    return name, url


def _pool(layout: str = "layer_first", dtype: torch.dtype = torch.bfloat16):
    return host_pool(LAYERS, HEADS, DIM, PAGE, 64, dtype=dtype, layout=layout)


def _fill(pool, indices: torch.Tensor, seed: int) -> None:
    """Random KV at the host slots `indices` (every layer, K and V)."""
    g = torch.Generator().manual_seed(seed)
    for s in indices[::PAGE].tolist():
        page = torch.randn(pool.get_dummy_flat_data_page().shape, generator=g).to(pool.dtype)
        pool.set_from_flat_data_page(s, page)


def _pages(pool, indices: torch.Tensor) -> list[torch.Tensor]:
    return [pool.get_data_page(s, flat=True).clone() for s in indices[::PAGE].tolist()]


def _hashes(n_pages: int, salt: int = 0) -> list[str]:
    tokens = [salt * 100_000 + t for t in range(n_pages * PAGE)]
    return get_storage_hash_str(tokens, None, page_size=PAGE)


def _backup(store, pool, keys: list[str], seed: int = 1) -> torch.Tensor:
    """Write `keys` from fresh host slots as the controller's backup does; returns the slots."""
    slots = pool.alloc(len(keys) * PAGE)
    _fill(pool, slots, seed)
    assert all(store.batch_set_v1(keys, slots, None))
    return slots


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_round_trip_exact_through_host_pool(backend: tuple[str, str], layout: str) -> None:
    _, url = backend
    pool = _pool(layout)
    store = ours(url, pool)
    keys = _hashes(5)
    src = _backup(store, pool, keys)
    assert store.batch_exists(keys, None) == 5
    dst = pool.alloc(5 * PAGE)
    assert store.batch_get_v1(keys, dst, None) == [True] * 5
    for a, b in zip(_pages(pool, src), _pages(pool, dst), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    store.check_integrity()


def test_batch_exists_counts_the_consecutive_run(backend: tuple[str, str]) -> None:
    _, url = backend
    pool = _pool()
    store = ours(url, pool)
    keys = _hashes(6)
    _backup(store, pool, keys[:3])
    _backup(store, pool, keys[4:])  # page 3 missing
    assert store.batch_exists(keys, None) == 3
    assert store.batch_exists(keys[4:], None) == 2
    assert store.batch_exists(keys[3:], None) == 0
    got = store.batch_get_v1(keys, pool.alloc(6 * PAGE), None)
    assert got == [True, True, True, False, False, False]


def test_other_model_dtype_or_tp_layout_never_hits(backend: tuple[str, str]) -> None:
    _, url = backend
    pool = _pool()
    keys = _hashes(3)
    _backup(ours(url, pool, model="org/model-a"), pool, keys)
    assert ours(url, pool, model="org/model-a").batch_exists(keys, None) == 3
    others = [
        ours(url, pool, model="org/model-b"),
        ours(url, _pool(dtype=torch.float16), model="org/model-a"),
        ours(url, pool, model="org/model-a", tp=(0, 2)),
        ours(url, _pool("page_first"), model="org/model-a"),
    ]
    for other in others:
        assert other.batch_exists(keys, None) == 0
        assert other.batch_get_v1(keys, other.mem_pool_host.alloc(3 * PAGE), None) == [False] * 3


def test_flipped_bit_is_a_miss_for_us_and_wrong_bytes_for_sglang_file(
    backend: tuple[str, str], tmp_path: Path
) -> None:
    name, url = backend
    pool = _pool()
    store = ours(url, pool)
    keys = _hashes(1)
    src = _backup(store, pool, keys)
    FLIPPERS[name](url)
    assert store.batch_get_v1(keys, pool.alloc(PAGE), None) == [False]
    assert store.store_stats()["corrupt"] == 1
    # SGLang's own file backend, the same page and the same flip in its file: it returns the
    # changed bytes as KV (its pages carry no checksum).
    theirs = attach("file", storage_config("m", {"file_storage_path": str(tmp_path / "sg")}), pool)
    original = _pages(pool, src)[0]
    assert theirs.batch_set(keys, [original])
    (path,) = [p for p in (tmp_path / "sg").iterdir() if p.suffix == ".bin"]
    data = bytearray(path.read_bytes())
    data[7] ^= 0x10
    path.write_bytes(bytes(data))
    (got,) = theirs.batch_get(keys, [pool.get_dummy_flat_data_page()])
    assert got is not None
    assert not torch.equal(got.view(torch.int16), original.view(torch.int16))
    diff = (got.view(torch.uint8) != original.view(torch.uint8)).sum().item()
    assert diff == 1  # exactly the flipped byte came back as KV


def test_generic_calls_get_set_exists_clear_stats(backend: tuple[str, str]) -> None:
    _, url = backend
    pool = _pool()
    store = ours(url, pool)
    keys = _hashes(3, salt=7)
    slots = pool.alloc(3 * PAGE)
    _fill(pool, slots, seed=3)
    pages = [pool.get_data_page(s, flat=True) for s in slots[::PAGE].tolist()]
    assert store.batch_set(keys, pages)
    assert store.exists(keys[0]) and store.batch_exists(keys, None) == 3
    out = store.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(a, b) for a, b in zip(out, pages, strict=True))
    assert store.set("single", pages[0])
    assert torch.equal(store.get("single", pool.get_dummy_flat_data_page()), pages[0])
    assert store.get("absent", pool.get_dummy_flat_data_page()) is None
    store.batch_set_v1(keys, slots, None)
    store.batch_get_v1(keys, pool.alloc(3 * PAGE), None)
    stats = store.get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert store.get_stats().backup_pgs == []  # reset by the read
    assert store.clear() is True
    assert store.batch_exists(keys, None) == 0 and not store.exists("single")
    store.check_integrity()


def test_missing_url_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="storage_url"):
        attach(
            "dynamic",
            storage_config(
                "m",
                {
                    "backend_name": "kvstrata",
                    "module_path": "kvstrata.integrations.sglang_storage",
                    "class_name": "KvstrataHiCacheStorage",
                },
            ),
            _pool(),
        )

"""Redis backend against a real redis-server: round trips, corruption, crash and reconnect."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import redis

from kvstrata.cache.keys import key_hex
from kvstrata.local_ports import refused_port
from kvstrata.storage.base import HEADER_NBYTES, StorageConfig, open_storage
from kvstrata.storage.config import storage_config
from kvstrata.storage.redis_store import RedisStore

try:
    from tests.redis_server import RedisServer
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from redis_server import RedisServer  # type: ignore[no-redef]

PAGE = 4096
_MASK64 = (1 << 64) - 1
FAST = storage_config(
    socket_timeout_s=0.5,
    connect_timeout_s=0.2,
    reconnect_backoff_s=0.05,
    reconnect_backoff_max_s=0.2,
)


def make_keys(n: int, salt: int = 0) -> list[int]:
    return [((i + 1) * 0x9E3779B97F4A7C15_F39CC0605CEDC834 + salt) % (1 << 128) for i in range(n)]


def page_for(key: int) -> np.ndarray:
    return np.random.default_rng(key & _MASK64).integers(0, 256, PAGE, dtype=np.uint8)


def _server() -> RedisServer:
    try:
        return RedisServer().start()
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def shared_server() -> Iterator[RedisServer]:
    server = _server()
    yield server
    server.stop()


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server this test alone may kill and restart."""
    server = _server()
    yield server
    server.stop()


@pytest.fixture
def store(shared_server: RedisServer, request: pytest.FixtureRequest) -> Iterator[RedisStore]:
    cfg = storage_config(redis_key_prefix=f"t-{request.node.name}:", redis_batch_pages=4)
    s = open_storage(shared_server.url, PAGE, cfg)
    assert isinstance(s, RedisStore)
    yield s
    s.check_integrity()
    s.close()


def test_round_trip_is_exact_across_batches(store: RedisStore) -> None:
    keys = make_keys(10)  # 10 pages in batches of 4: three round trips
    pages = [page_for(k) for k in keys]
    assert store.put(keys, pages) == 10
    assert store.exists_prefix(keys) == 10
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 10
    for o, p in zip(out, pages, strict=True):
        np.testing.assert_array_equal(o, p)
    st = store.stats()
    assert st["puts"] == 10 and st["get_hits"] == 10 and st["put_skipped"] == 0
    assert store.delete(keys[8:] + make_keys(1, salt=5)) == 2
    assert store.exists_prefix(keys) == 8


def test_prefix_counts_stop_at_first_miss(store: RedisStore) -> None:
    keys = make_keys(9)
    present = [0, 1, 2, 3, 4, 6, 7]  # key 5 missing, in the second batch of 4
    assert store.put([keys[i] for i in present], [page_for(keys[i]) for i in present]) == 7
    assert store.exists_prefix(keys) == 5
    assert store.exists_prefix(keys[6:]) == 2
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 5
    assert not out[6].any(), "get copied past the first miss"


def test_corrupt_or_foreign_values_are_misses_and_deleted(
    store: RedisStore, shared_server: RedisServer
) -> None:
    keys = make_keys(4)
    assert store.put(keys, [page_for(k) for k in keys]) == 4
    raw = redis.Redis.from_url(shared_server.url)
    prefix = store.config.redis_key_prefix
    name1, name2 = (f"{prefix}{key_hex(k)}" for k in keys[1:3])
    value = bytearray(raw.get(name1))
    value[HEADER_NBYTES + 7] ^= 0x10
    raw.set(name1, bytes(value))  # one flipped payload bit
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 1
    assert raw.exists(name1) == 0 and store.stats()["corrupt"] == 1
    assert store.put(keys[1:2], [page_for(keys[1])]) == 1
    raw.set(name2, raw.get(f"{prefix}{key_hex(keys[3])}"))  # a whole valid page of another key
    assert store.exists_prefix(keys) == 4  # exists only checks the length
    assert store.get(keys, out) == 2 and raw.exists(name2) == 0
    raw.set(name2, b"short")
    assert store.exists_prefix(keys) == 2 and store.get(keys, out) == 2
    raw.close()


def test_key_prefixes_isolate_stores(shared_server: RedisServer) -> None:
    a = open_storage(shared_server.url, PAGE, storage_config(redis_key_prefix="iso-a:"))
    b = open_storage(shared_server.url, PAGE, storage_config(redis_key_prefix="iso-b:"))
    keys = make_keys(2)
    assert a.put(keys, [page_for(k) for k in keys]) == 2
    assert b.exists_prefix(keys) == 0 and a.exists_prefix(keys) == 2


def test_bad_input_and_bad_urls_are_value_errors(store: RedisStore) -> None:
    with pytest.raises(ValueError, match="4096 bytes"):
        store.put(make_keys(1), [np.zeros(PAGE - 1, np.uint8)])
    with refused_port() as port:  # bound, never listening: no neighbour's server can take it
        with pytest.raises(ValueError, match=f"redis://127.0.0.1:{port}/0.*unreachable"):
            open_storage(f"redis://127.0.0.1:{port}/0", PAGE, FAST)
    with pytest.raises(ValueError, match="redis://127.0.0.1:notaport"):
        open_storage("redis://127.0.0.1:notaport/0", PAGE, FAST)


def test_unreachable_allowed_at_start_gives_misses_then_connects(own_server: RedisServer) -> None:
    own_server.kill()
    cfg = StorageConfig(redis=replace(FAST.redis, require_reachable_at_start=False))
    store = open_storage(own_server.url, PAGE, cfg)
    keys = make_keys(3)
    assert store.put(keys, [page_for(k) for k in keys]) == 0
    assert store.exists_prefix(keys) == 0
    assert store.stats()["connection_errors"] >= 1
    own_server.start()
    assert _wait_until(lambda: store.put(keys, [page_for(k) for k in keys]) == 3)
    assert store.exists_prefix(keys) == 3
    store.close()


def _wait_until(cond: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_server_crash_gives_misses_and_restart_reconnects(own_server: RedisServer) -> None:
    store = open_storage(own_server.url, PAGE, FAST)
    keys = make_keys(6)
    pages = [page_for(k) for k in keys]
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.put(keys, pages) == 6 and store.get(keys, out) == 6
    own_server.kill()
    t0 = time.monotonic()
    for _ in range(5):  # no exception reaches the caller; every call is a miss or a skip
        assert store.get(keys, out) == 0
        assert store.exists_prefix(keys) == 0
        assert store.put(keys, pages) == 0
        assert store.delete(keys) == 0
        time.sleep(0.03)
    assert time.monotonic() - t0 < 5.0, "a dead server must not stall the caller"
    st = store.stats()
    assert st["connection_errors"] >= 1 and st["put_skipped"] == 30 and st["get_misses"] >= 5
    store.check_integrity()
    own_server.restart()  # same port, empty (no persistence)
    assert _wait_until(lambda: store.put(keys, pages) == 6), store.stats()
    assert store.get(keys, out) == 6
    for o, p in zip(out, pages, strict=True):
        np.testing.assert_array_equal(o, p)
    assert store.stats()["reconnects"] >= 1 and store.stats()["down"] == 0
    store.check_integrity()
    store.close()


def test_hung_server_times_out_into_misses(own_server: RedisServer) -> None:
    import signal

    # a backoff the next line surely falls in, even on a loaded machine (FAST's 0.05 s can pass
    # before the put starts; then the put waits out a second socket timeout)
    slow_retry = replace(FAST.redis, reconnect_backoff_s=2.0, reconnect_backoff_max_s=2.0)
    cfg = StorageConfig(redis=slow_retry)
    store = open_storage(own_server.url, PAGE, cfg)
    keys = make_keys(2)
    pages = [page_for(k) for k in keys]
    assert store.put(keys, pages) == 2
    assert own_server.proc is not None
    own_server.proc.send_signal(signal.SIGSTOP)  # alive but silent: only the socket timeout helps
    try:
        assert store.get(keys, [np.zeros(PAGE, np.uint8) for _ in keys]) == 0
        assert store.put(keys, pages) == 0  # within the backoff: skipped at once
        # the get waited out the socket timeout once; the put did not reach the server at all
        st = store.stats()
        assert st["connection_errors"] == 1 and st["calls_skipped_down"] == 1, st
    finally:
        own_server.proc.send_signal(signal.SIGCONT)
    assert _wait_until(lambda: store.exists_prefix(keys) == 2)
    store.close()


def test_server_out_of_memory_is_a_counted_skip(own_server: RedisServer) -> None:
    raw = redis.Redis.from_url(own_server.url)
    raw.config_set("maxmemory", 2 * 1024 * 1024)
    raw.config_set("maxmemory-policy", "noeviction")
    store = open_storage(own_server.url, PAGE, storage_config(redis_batch_pages=8))
    keys = make_keys(2000)  # ~8 MiB: far over the limit
    stored = store.put(keys, [page_for(keys[0])] * len(keys))
    assert 0 < stored < len(keys)
    st = store.stats()
    assert st["server_errors"] >= 1 and st["put_skipped"] == len(keys) - stored
    assert 0 < store.exists_prefix(keys) <= stored and st["down"] == 0  # the link itself is fine
    raw.close()
    store.close()

"""The networked storage backends in `kvstrata bench storage`: mooncake and redis vs their own
clients.

Each backend gets a server this bench starts (a mooncake_master with its HTTP metadata server, a
redis-server; both on 127.0.0.1, free ports) and is measured two ways on the same 2 MiB pages:
- ours: `MooncakeStore` / `RedisStore` put and get in batches (header + xxh3-64 checksum per
  page, verified on read; mooncake pages come from a registered host-pool buffer, zero-copy);
- baseline: a plain loop over the backend's own client library, one put and one get per page of
  the same bytes (`MooncakeDistributedStore.put/get`, redis-py `set/get`), through the same
  client connection (mooncake: the same client and segment).
The sides alternate batch by batch so both see the same load on a shared machine; ratios are
baseline_time / our_time (goal >= 0.8). Probe latency: one `exists_prefix` over 1,000 stored
keys (small pages), against the plain batched existence call (batch_is_exist / pipelined EXISTS).
A backend whose server cannot start here is reported as skipped with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstrata.bench.local_mooncake import MooncakeMaster
from kvstrata.bench.local_redis import RedisServer
from kvstrata.bench.storage_sealed import sealed_rows_over
from kvstrata.cache.keys import key_hex
from kvstrata.storage.base import StorageBackend, StorageConfig, open_storage
from kvstrata.storage.config import MooncakeStoreConfig

PAGE = 2 * 1024 * 1024
PROBE_KEYS = 1000
PROBE_PAGE = 4096
PROBE_REPEATS = 20
# what `kvstrata bench storage` lifts to its top level (the printed table) per backend
NET_KEYS = (
    "put_ratio", "get_ratio", "ours_put_gbps", "ours_get_gbps", "base_put_gbps",
    "base_get_gbps", "probe_ms", "probe_base_ms",
)  # fmt: skip


@dataclass(frozen=True)
class PlainClient:
    """The baseline: the backend's own client, one call per page, and its batched existence."""

    put: Callable[[str, np.ndarray], object]
    get: Callable[[str], object]
    exists: Callable[[list[str]], object]
    name: Callable[[int], str]  # our key -> the backend's object name (same bytes, own namespace)


class _Clock:
    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.turns = 0

    def alternate(self, steps: dict[str, Callable[[], object]]) -> None:
        items = list(steps.items())
        for side, fn in items if self.turns % 2 == 0 else items[::-1]:
            t0 = time.perf_counter()
            fn()
            self.wall[side] = self.wall.get(side, 0.0) + time.perf_counter() - t0
        self.turns += 1


def _throughput(
    store: StorageBackend, plain: PlainClient, pool: np.ndarray, n_pages: int, batch: int
) -> dict[str, float]:
    """Put then get `n_pages` 2 MiB pages both ways, batch by batch, alternating sides."""
    clock, src = _Clock(), len(pool) // 2  # pool[:src] source pages, pool[src:] read buffers
    batches = [range(lo, min(lo + batch, n_pages)) for lo in range(0, n_pages, batch)]

    def ours_put(ids: range) -> None:
        assert store.put([i + 1 for i in ids], [pool[i % src] for i in ids]) == len(ids)

    def base_put(ids: range) -> None:
        for i in ids:
            plain.put(plain.name(i + 1), pool[i % src])

    def ours_get(ids: range) -> None:
        assert store.get([i + 1 for i in ids], list(pool[src : src + len(ids)])) == len(ids)

    def base_get(ids: range) -> None:
        for i in ids:
            assert len(plain.get(plain.name(i + 1))) == PAGE  # type: ignore[arg-type]

    for ids in batches:
        clock.alternate(
            {"ours_put": lambda i=ids: ours_put(i), "base_put": lambda i=ids: base_put(i)}
        )
    for ids in batches:
        clock.alternate(
            {"ours_get": lambda i=ids: ours_get(i), "base_get": lambda i=ids: base_get(i)}
        )
    last = batches[-1]
    assert np.array_equal(pool[src + len(last) - 1], pool[(n_pages - 1) % src]), "wrong bytes"
    w, nbytes = clock.wall, n_pages * PAGE
    return {
        "put_ratio": w["base_put"] / w["ours_put"],
        "get_ratio": w["base_get"] / w["ours_get"],
        **{f"{k}_gbps": nbytes / v / 1e9 for k, v in sorted(w.items())},
    }


def probe_ms(store: StorageBackend, plain: PlainClient | None) -> dict[str, float]:
    """Mean ms of one exists_prefix over PROBE_KEYS stored keys (and of the plain call)."""
    keys = [(1 << 100) + i for i in range(PROBE_KEYS)]
    page = np.ones(PROBE_PAGE, np.uint8)
    assert store.put(keys, [page] * len(keys)) == len(keys), "probe pages were not stored"
    t0 = time.perf_counter()
    for _ in range(PROBE_REPEATS):
        assert store.exists_prefix(keys) == len(keys)
    out = {"probe_ms": (time.perf_counter() - t0) / PROBE_REPEATS * 1e3}
    if plain is not None:
        names = [plain.name(k) for k in keys]
        t0 = time.perf_counter()
        for _ in range(PROBE_REPEATS):
            plain.exists(names)
        out["probe_base_ms"] = (time.perf_counter() - t0) / PROBE_REPEATS * 1e3
    store.delete(keys)
    return out


def _measure(url: str, plain_of: Callable[[Any], PlainClient], quick: bool) -> dict[str, Any]:
    n_pages = 64 if quick else 256  # 128 MiB / 512 MiB each way per side
    batch = 16
    store = open_storage(
        url, PAGE, StorageConfig(mooncake=MooncakeStoreConfig(mooncake_batch_pages=batch))
    )
    try:
        plain = plain_of(store)
        pool = np.random.default_rng(0).integers(0, 256, (2 * batch, PAGE), dtype=np.uint8)
        registered = getattr(store, "register_buffer", None)
        if registered is not None:
            registered(pool)  # a host pool registered once: our pages move zero-copy
        report = {
            "page_nbytes": PAGE,
            "pages": n_pages,
            **_throughput(store, plain, pool, n_pages, batch),
        }
        store.delete([i + 1 for i in range(n_pages)])
        probe_store = open_storage(url, PROBE_PAGE, StorageConfig())
        report.update(probe_ms(probe_store, plain_of(probe_store)))
        probe_store.close()
        return report
    finally:
        store.close()


def _mooncake_plain(store: Any) -> PlainClient:
    raw = store.client.store  # the wheel's MooncakeDistributedStore of our client
    return PlainClient(
        put=raw.put, get=raw.get, exists=raw.batch_is_exist, name=lambda k: "plain:" + key_hex(k)
    )


def _redis_plain(store: Any) -> PlainClient:
    raw = store._client  # the redis-py client of our store (same connection pool)

    def exists(names: list[str]) -> object:
        pipe = raw.pipeline(transaction=False)
        for n in names:
            pipe.exists(n)
        return pipe.execute()

    return PlainClient(
        put=lambda name, page: raw.set(name, memoryview(page)),
        get=raw.get,
        exists=exists,
        name=lambda k: "plain:" + key_hex(k),
    )


def bench_mooncake(quick: bool) -> dict[str, Any]:
    try:
        master = MooncakeMaster().start()
    except RuntimeError as e:
        return {"skipped": str(e)}
    try:
        segment = f"{(2 * (256 if not quick else 64) + 64) * PAGE}"  # ours + baseline + slack
        report = _measure(master.url(segment=segment, buffer="128m"), _mooncake_plain, quick)
        report["sealed"] = _sealed_mooncake(master, (16 if quick else 64) << 20)
        return report
    finally:
        master.stop()


def _sealed_mooncake(master: MooncakeMaster, total: int) -> list[dict[str, Any]]:
    """Sealed units over Mooncake vs plain ones (storage_sealed's rows), pages registered."""
    segment = 3 * total * 11 // 10 + (64 << 20)  # three sides' units + headers + slack
    url = master.url(segment=str(segment), buffer="64m")
    cfg = StorageConfig()

    def open_store(side: str, value_nbytes: int) -> StorageBackend:
        return open_storage(url + f"&prefix=sealed-{side}-{value_nbytes}:", value_nbytes, cfg)

    return [{"backend": "mooncake", **row} for row in sealed_rows_over(open_store, total)]


def bench_redis(quick: bool) -> dict[str, Any]:
    try:
        server = RedisServer().start()
    except RuntimeError as e:
        return {"skipped": str(e)}
    try:
        return _measure(server.url, _redis_plain, quick)
    finally:
        server.stop()


def file_probe_ms(root: str) -> dict[str, float]:
    """The file backend's probe of 1,000 stored keys (no baseline: it is one stat per key)."""
    store = open_storage(f"file://{root}", PROBE_PAGE, StorageConfig())
    try:
        return probe_ms(store, None)
    finally:
        store.close()

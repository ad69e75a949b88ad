"""Storage registry, config, page format and namespace isolation (file and redis backends)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstrata.cache.keys import Namespace, page_keys
from kvstrata.storage.base import (
    HEADER_NBYTES,
    STORAGE_BACKENDS,
    StorageBackend,
    StorageConfig,
    encode_header,
    header_ok,
    open_storage,
)
from kvstrata.storage.config import storage_config
from kvstrata.storage.file_store import FileStore
from kvstrata.storage.redis_store import RedisStore

try:
    from tests.redis_server import RedisServer
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from redis_server import RedisServer  # type: ignore[no-redef]

PAGE = 4096


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    try:
        server = RedisServer().start()
    except RuntimeError as e:
        pytest.fail(str(e))
    yield server.url
    server.stop()


def test_unknown_scheme_lists_known_schemes() -> None:
    with pytest.raises(ValueError, match=r"unknown storage URL scheme 'nope'.*file.*redis"):
        open_storage("nope://somewhere", PAGE)


def test_plain_path_and_file_url_open_the_file_backend(tmp_path: Path) -> None:
    a = open_storage(str(tmp_path / "a"), PAGE)
    b = open_storage(f"file://{tmp_path / 'b'}", PAGE, StorageConfig())
    assert isinstance(a, FileStore) and isinstance(b, FileStore)
    assert a.root == tmp_path / "a" and b.root == tmp_path / "b"
    assert isinstance(a, StorageBackend)
    assert set(STORAGE_BACKENDS.names()) >= {"file", "redis"}


@pytest.mark.parametrize("bad", [0, -5, 1.5, "4096", True])
def test_bad_page_nbytes_is_a_value_error(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="page_nbytes"):
        open_storage(str(tmp_path), bad)  # type: ignore[arg-type]


def test_every_config_field_is_documented() -> None:
    for f in dataclasses.fields(StorageConfig):
        assert f.metadata.get("help"), f"StorageConfig.{f.name} has no doc()"


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_bytes", -1), ("evict_to_fraction", 0.0), ("evict_to_fraction", 1.5), ("redis_batch_pages", 0),
     ("socket_timeout_s", 0.0), ("reconnect_backoff_max_s", 0.01), ("redis_ttl_s", -1),
     ("stale_unit_s", 0), ("stale_unit_s", 599)],
)  # fmt: skip
def test_bad_config_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        storage_config(**{field: value})


def test_header_round_trip_and_rejections() -> None:
    page = np.arange(PAGE, dtype=np.uint8)
    key = (1 << 127) + 12345
    hdr = encode_header(key, page)
    assert len(hdr) == HEADER_NBYTES
    assert header_ok(hdr, key, PAGE) is not None
    assert header_ok(hdr, key + 1, PAGE) is None  # stored under another key
    assert header_ok(hdr, key, PAGE + 1) is None  # wrong page size
    assert header_ok(hdr[:-1], key, PAGE) is None  # truncated
    assert header_ok(b"XXXX" + hdr[4:], key, PAGE) is None  # bad magic


NAMESPACES = [
    Namespace(model_fingerprint="m1", kv_dtype="float32", tenant_salt=""),
    Namespace(model_fingerprint="m1", kv_dtype="float32", tenant_salt="tenant-b"),
    Namespace(model_fingerprint="m2", kv_dtype="float32", tenant_salt=""),
    Namespace(model_fingerprint="m1", kv_dtype="bfloat16", tenant_salt=""),
]


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_namespaces_never_hit_each_others_pages(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = str(tmp_path / "store") if backend == "file" else request.getfixturevalue("redis_url")
    store = open_storage(url, PAGE, storage_config(redis_key_prefix=f"ns-test-{tmp_path.name}:"))
    assert isinstance(store, FileStore if backend == "file" else RedisStore)
    tokens = np.arange(4 * 64, dtype=np.int32) % 1000  # the same tokens under every namespace
    keys = [page_keys(tokens, ns) for ns in NAMESPACES]
    pages = [
        [np.full(PAGE, 10 * n + i, np.uint8) for i in range(4)] for n in range(len(NAMESPACES))
    ]
    out = [np.zeros(PAGE, np.uint8) for _ in range(4)]
    assert store.put(keys[0], pages[0]) == 4
    for other in keys[1:]:  # only namespace 0 is stored: nobody else sees it
        assert not set(other) & set(keys[0])
        assert store.exists_prefix(other) == 0 and store.get(other, out) == 0
    for n in range(1, len(NAMESPACES)):
        assert store.put(keys[n], pages[n]) == 4
    for n in range(len(NAMESPACES)):  # each namespace reads back exactly its own bytes
        assert store.get(keys[n], out) == 4
        assert all(np.array_equal(o, p) for o, p in zip(out, pages[n], strict=True))
    store.check_integrity()
    store.close()

"""Storage options per backend: each backend's config holds exactly its options, and a store opened
from a command line giving every option of its backend holds every one of them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvstrata.cli.main import build_parser
from kvstrata.cli.run_cmd import STORAGE_PREFIX
from kvstrata.cli.storage_options import storage_config_from_args
from kvstrata.storage.base import open_storage
from kvstrata.storage.config import (
    BACKEND_CONFIGS,
    FileStoreConfig,
    MemoryStoreConfig,
    MooncakeStoreConfig,
    RedisStoreConfig,
    StorageConfig,
    option_fields,
    read_by,
    storage_config,
)
from kvstrata.storage.memory_store import MemoryStorage

PAGE = 4096
RETRY = {"connect_timeout_s", "reconnect_backoff_s", "reconnect_backoff_max_s"}
FIELDS: dict[type, set[str]] = {
    StorageConfig: {
        "emulate_read_s_per_page", "read_threads", "key_file", "encrypt", "file", "memory",
        "redis", "mooncake",
    },
    FileStoreConfig: {
        "max_bytes", "evict_to_fraction", "rescan_interval_s", "fsync", "create_dir",
        "touch_on_read", "stale_tmp_s", "stale_unit_s", "seal_check_thread", "group_access",
    },
    MemoryStoreConfig: {"max_bytes"},
    RedisStoreConfig: {
        "stale_unit_s", "redis_key_prefix", "redis_ttl_s", "redis_batch_pages",
        "socket_timeout_s", *RETRY, "require_reachable_at_start",
    },
    MooncakeStoreConfig: {
        "mooncake_batch_pages", "mooncake_timeout_s", "mooncake_setup_timeout_s", *RETRY,
        "require_reachable_at_start",
    },
}  # fmt: skip

# a value other than the default for every backend option, as given on the command line
GIVEN = {
    "max_bytes": ["--storage-max-bytes", "1048576"],
    "evict_to_fraction": ["--storage-evict-to-fraction", "0.5"],
    "rescan_interval_s": ["--storage-rescan-interval-s", "7"],
    "fsync": ["--storage-fsync"],
    "create_dir": ["--no-storage-create-dir"],
    "touch_on_read": ["--no-storage-touch-on-read"],
    "stale_tmp_s": ["--storage-stale-tmp-s", "5"],
    "stale_unit_s": ["--storage-stale-unit-s", "700"],
    "seal_check_thread": ["--storage-seal-check-thread"],
    "group_access": ["--storage-group-access"],
    "redis_key_prefix": ["--storage-redis-key-prefix", "cfg-test:"],
    "redis_ttl_s": ["--storage-redis-ttl-s", "9"],
    "redis_batch_pages": ["--storage-redis-batch-pages", "3"],
    "socket_timeout_s": ["--storage-socket-timeout-s", "0.3"],
    "connect_timeout_s": ["--storage-connect-timeout-s", "0.1"],
    "reconnect_backoff_s": ["--storage-reconnect-backoff-s", "0.05"],
    "reconnect_backoff_max_s": ["--storage-reconnect-backoff-max-s", "0.1"],
    "require_reachable_at_start": ["--no-storage-require-reachable-at-start"],
    "mooncake_batch_pages": ["--storage-mooncake-batch-pages", "2"],
    "mooncake_timeout_s": ["--storage-mooncake-timeout-s", "0.5"],
    "mooncake_setup_timeout_s": ["--storage-mooncake-setup-timeout-s", "1"],
}


def test_each_config_holds_exactly_its_fields_each_documented() -> None:
    for cls, names in FIELDS.items():
        got = dataclasses.fields(cls)
        assert {f.name for f in got} == names, cls.__name__
        for f in got:
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no doc()"
    backend_options = set(option_fields()) - {
        "emulate_read_s_per_page",
        "read_threads",
        "key_file",
        "encrypt",
    }
    assert backend_options == set(GIVEN)
    assert read_by("key_file") is None and read_by("redis_ttl_s") == ("redis", "rediss")
    assert read_by("max_bytes") == ("file", "mem")
    assert read_by("connect_timeout_s") == ("redis", "rediss", "mooncake")


def test_a_shared_option_fills_every_config_holding_it() -> None:
    cfg = storage_config(max_bytes=8192, connect_timeout_s=0.1, stale_unit_s=900, key_file="k")
    assert cfg.file.max_bytes == cfg.memory.max_bytes == 8192
    assert cfg.redis.connect_timeout_s == cfg.mooncake.connect_timeout_s == 0.1
    assert cfg.file.stale_unit_s == cfg.redis.stale_unit_s == 900
    assert cfg.key_file == "k"
    assert cfg.redis.redis_ttl_s == RedisStoreConfig().redis_ttl_s  # the rest: defaults
    with pytest.raises(TypeError, match="unknown storage options: bogus"):
        storage_config(bogus=1)


@pytest.mark.parametrize(
    "url",
    ["file://DIR", "mem://", "redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0",
     "mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2"],
)  # fmt: skip
def test_a_backends_opener_ignores_no_option_given_for_it(url: str, tmp_path: Path) -> None:
    url = url.replace("DIR", str(tmp_path))  # exists: --no-storage-create-dir opens it
    scheme = url.split("://", 1)[0]
    mine = [name for name in GIVEN if scheme in (read_by(name) or ())]
    argv = [a for name in mine for a in GIVEN[name]]
    args = build_parser().parse_args(["serve", "--storage-url", url, *argv])
    cfg = storage_config_from_args(args, STORAGE_PREFIX)
    own = getattr(cfg, BACKEND_CONFIGS[scheme])
    changed = {f.name for f in dataclasses.fields(own) if getattr(own, f.name) != f.default}
    assert changed == set(mine) == {f.name for f in dataclasses.fields(own)}
    store = open_storage(url, PAGE, cfg)
    try:
        if isinstance(store, MemoryStorage):  # keeps no config: its cap in pages
            assert store.max_pages == own.max_bytes // PAGE
        else:
            assert store.config == own  # type: ignore[attr-defined]
    finally:
        store.close()

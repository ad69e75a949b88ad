"""Storage configs: what every store reads (`StorageConfig`), composing one frozen config per
backend (`FileStoreConfig`, `MemoryStoreConfig`, `RedisStoreConfig`, `MooncakeStoreConfig`).

A backend's opener reads only its own config. An option several backends read (`max_bytes`,
`connect_timeout_s`, ...) is a field of each of their configs, made by one field function here
(one help text, one default); on the command line it is one `--storage-NAME` option that fills
every config holding field NAME (`storage_config`), and is refused with a store of a backend whose
config lacks it (kvstrata.cli.validate.check_storage_options, through `read_by`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvstrata.configtools import doc


# ---- fields several backends read (one definition each) -----------------------------------------
def _max_bytes() -> Any:
    return doc(0, "size cap of the store in bytes (0 = unbounded); file: LRU clean-up")


def _stale_unit_s() -> Any:
    return doc(
        3600,
        "units of a page still uncommitted this long after their last write are removed (a "
        "killed backup); must exceed the longest backup (>= stale_tmp_s)",
    )


def _connect_timeout_s() -> Any:
    return doc(0.5, "socket connect timeout in seconds (mooncake: reachability)")


def _reconnect_backoff_s() -> Any:
    return doc(0.2, "first wait after a connection failure before retrying")


def _reconnect_backoff_max_s() -> Any:
    return doc(5.0, "the wait doubles per failure up to this")


def _require_reachable_at_start() -> Any:
    return doc(True, "an unreachable server at construction is a ValueError")


def _check_max_bytes(max_bytes: int) -> None:
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")


def _check_stale_unit_s(stale_unit_s: int, stale_tmp_s: float) -> None:
    if stale_unit_s < max(1.0, stale_tmp_s):
        raise ValueError(
            f"stale_unit_s must be >= stale_tmp_s ({stale_tmp_s}) and >= 1, got {stale_unit_s}"
        )


def _check_reconnect(cfg: RedisStoreConfig | MooncakeStoreConfig) -> None:
    if cfg.reconnect_backoff_max_s < cfg.reconnect_backoff_s:
        raise ValueError("reconnect_backoff_max_s must be >= reconnect_backoff_s")


def _require_above_zero(cfg: object, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")


# ---- one config per backend ---------------------------------------------------------------------
@dataclass(frozen=True)
class FileStoreConfig:
    """The file backend's options (`file://DIR` or a plain path)."""

    max_bytes: int = _max_bytes()
    evict_to_fraction: float = doc(
        0.9, "on overflow, remove oldest pages until this fraction of max_bytes"
    )
    rescan_interval_s: float = doc(
        30.0, "rescan the directory size this often (other processes write too)"
    )
    fsync: bool = doc(False, "fsync each page file before it is renamed into place")
    create_dir: bool = doc(True, "create the directory if missing (its parent must exist)")
    touch_on_read: bool = doc(True, "a read refreshes the page's mtime (the LRU clock)")
    stale_tmp_s: float = doc(
        600.0, "temp files older than this are removed at rescan (crashed writers)"
    )
    stale_unit_s: int = _stale_unit_s()
    seal_check_thread: bool = doc(
        False,
        "with key_file: check each unit's seal on a second thread while the next unit is read "
        "(on machines with >= 2 cores); off (default: measured faster on a quiet 2-core VAES "
        "machine, `bench storage`'s sealed mac/encrypted sides vs *_thread): read then check "
        "on one thread",
    )
    group_access: bool = doc(
        False,
        "files 0660 and directories 0770 (workers of one group share the store); default "
        "owner-only, 0600 and 0700",
    )

    def __post_init__(self) -> None:
        _check_max_bytes(self.max_bytes)
        if not 0.0 < self.evict_to_fraction <= 1.0:
            raise ValueError(f"evict_to_fraction must be in (0, 1], got {self.evict_to_fraction}")
        _require_above_zero(self, "rescan_interval_s")
        _check_stale_unit_s(self.stale_unit_s, self.stale_tmp_s)


@dataclass(frozen=True)
class MemoryStoreConfig:
    """The in-process backend's options (`mem://`)."""

    max_bytes: int = _max_bytes()

    def __post_init__(self) -> None:
        _check_max_bytes(self.max_bytes)


@dataclass(frozen=True)
class RedisStoreConfig:
    """The redis backend's options (`redis://host:port/db`, `rediss://` over TLS)."""

    stale_unit_s: int = _stale_unit_s()
    redis_key_prefix: str = doc("kvstrata:", "prefix of every key (32 hex digits follow)")
    redis_ttl_s: int = doc(
        0, "expiry of stored pages in seconds (0 = none; use redis maxmemory-policy for LRU)"
    )
    redis_batch_pages: int = doc(32, "pages per pipelined round trip")
    socket_timeout_s: float = doc(1.0, "socket read/write timeout in seconds")
    connect_timeout_s: float = _connect_timeout_s()
    reconnect_backoff_s: float = _reconnect_backoff_s()
    reconnect_backoff_max_s: float = _reconnect_backoff_max_s()
    require_reachable_at_start: bool = _require_reachable_at_start()

    def __post_init__(self) -> None:
        if self.redis_batch_pages < 1:
            raise ValueError(f"redis_batch_pages must be >= 1, got {self.redis_batch_pages}")
        if self.redis_ttl_s < 0:
            raise ValueError(f"redis_ttl_s must be >= 0, got {self.redis_ttl_s}")
        _require_above_zero(self, "socket_timeout_s", "connect_timeout_s", "reconnect_backoff_s")
        _check_stale_unit_s(self.stale_unit_s, 1.0)  # no temp files here (file: stale_tmp_s)
        _check_reconnect(self)


@dataclass(frozen=True)
class MooncakeStoreConfig:
    """The Mooncake Store backend's options (`mooncake://host:rpc_port?metadata=...`)."""

    mooncake_batch_pages: int = doc(
        16,
        "pages per batched transfer (a get checks one batch while reading the next; its "
        "staging area holds two)",
    )
    mooncake_timeout_s: float = doc(
        5.0, "bound on every client call; one that outlives it marks it down"
    )
    mooncake_setup_timeout_s: float = doc(15.0, "bound on joining the master (the client's set-up)")
    connect_timeout_s: float = _connect_timeout_s()
    reconnect_backoff_s: float = _reconnect_backoff_s()
    reconnect_backoff_max_s: float = _reconnect_backoff_max_s()
    require_reachable_at_start: bool = _require_reachable_at_start()

    def __post_init__(self) -> None:
        if self.mooncake_batch_pages < 1:
            raise ValueError(f"mooncake_batch_pages must be >= 1, got {self.mooncake_batch_pages}")
        _require_above_zero(
            self,
            "connect_timeout_s",
            "reconnect_backoff_s",
            "mooncake_timeout_s",
            "mooncake_setup_timeout_s",
        )
        _check_reconnect(self)


# ---- what every backend and the layers above read -----------------------------------------------
@dataclass(frozen=True)
class StorageConfig:
    """Storage options every backend reads; a backend's own options follow in its group."""

    emulate_read_s_per_page: float = doc(
        0.0,
        "benchmarks: every read waits this long per page first (emulates remote storage)",
        debug=True,
    )
    read_threads: int = doc(
        4,
        "storage reads in flight at once, each on a thread of its own, where the store takes "
        "concurrent reads (file, mem, redis; a sealed or mooncake store reads one at a time); "
        "a write still runs alone, between the reads queued before and after it",
    )
    key_file: str = doc(
        "",
        "cluster key file (hex, `kvstrata keys cluster`): every stored unit carries a keyed MAC "
        "over its key, length and bytes, checked on read (a failure is a miss, counted as "
        "seal_failures); every reader and writer of the store needs the same key. Empty = none",
    )
    encrypt: bool = doc(
        False, "with key_file: units are also encrypted at rest (AES-256-GCM) instead of MAC'd only"
    )
    file: FileStoreConfig = doc(FileStoreConfig(), "the file backend's options", cli=False)
    memory: MemoryStoreConfig = doc(MemoryStoreConfig(), "the mem backend's options", cli=False)
    redis: RedisStoreConfig = doc(RedisStoreConfig(), "the redis backend's options", cli=False)
    mooncake: MooncakeStoreConfig = doc(
        MooncakeStoreConfig(), "the mooncake backend's options", cli=False
    )

    def __post_init__(self) -> None:
        if self.encrypt and not self.key_file:
            raise ValueError("encrypt needs key_file (the cluster key)")
        if self.read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {self.read_threads}")
        if self.emulate_read_s_per_page < 0:
            raise ValueError(
                f"emulate_read_s_per_page must be >= 0, got {self.emulate_read_s_per_page}"
            )


BACKEND_CONFIGS: dict[str, str] = {
    "file": "file",
    "mem": "memory",
    "redis": "redis",
    "rediss": "redis",  # redis over TLS: the redis backend
    "mooncake": "mooncake",
}
"""URL scheme -> the StorageConfig field holding its backend's config (schemes in help order)."""

_BACKEND_FIELDS = tuple(dict.fromkeys(BACKEND_CONFIGS.values()))  # file, memory, redis, mooncake


def common_fields() -> list[dataclasses.Field]:
    """StorageConfig's own options (those every backend reads), not the backend configs."""
    return [f for f in dataclasses.fields(StorageConfig) if f.name not in _BACKEND_FIELDS]


def backend_config_class(attr: str) -> type:
    """The config class of StorageConfig field `attr` (one of the backend configs)."""
    return type(getattr(StorageConfig(), attr))


def option_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every storage option by name -> (a config class holding it, its field): common ones
    first, then each backend's in scheme order; a field several backend configs hold appears
    once (they share its definition)."""
    out = {f.name: (StorageConfig, f) for f in common_fields()}
    for attr in _BACKEND_FIELDS:
        cls = backend_config_class(attr)
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, (cls, f))
    return out


def read_by(name: str) -> tuple[str, ...] | None:
    """The URL schemes whose backend reads option `name`; None: every backend (StorageConfig's)."""
    if any(f.name == name for f in common_fields()):
        return None
    return tuple(
        scheme
        for scheme, attr in BACKEND_CONFIGS.items()
        if any(f.name == name for f in dataclasses.fields(backend_config_class(attr)))
    )


def storage_config(**options: Any) -> StorageConfig:
    """StorageConfig from flat options (as the command line names them): each fills StorageConfig
    or every backend config holding a field of its name. TypeError names an unknown option."""
    unknown = set(options) - set(option_fields())
    if unknown:
        raise TypeError(f"unknown storage options: {', '.join(sorted(unknown))}")
    backends = {}
    for attr in _BACKEND_FIELDS:
        cls = backend_config_class(attr)
        names = {f.name for f in dataclasses.fields(cls)}
        backends[attr] = cls(**{k: v for k, v in options.items() if k in names})
    common = {f.name for f in common_fields()}
    return StorageConfig(**{k: v for k, v in options.items() if k in common}, **backends)

"""The connector's options, read from vLLM's `kv_connector_extra_config` by field name.

Every key is validated when vLLM builds the connector: an unknown key or a bad value raises
ConnectorConfigError, one line that names the key, before any byte is moved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, get_type_hints

from kvstrata.cache.policies import EVICTION, PREFETCH, WRITE
from kvstrata.configtools import doc
from kvstrata.memory.available import check_fits

COPY_MODES = ("auto", "step", "layer")
"""How host <-> vLLM copies run: "step" all layers at once (loads before the forward, stores after
it, on vLLM's thread); "layer" layer by layer on a copy thread (layer l+1 loads while layer l
computes, a layer's store starts once vLLM saved it); "auto": layer on CUDA, step on CPU."""


class ConnectorConfigError(ValueError):
    """A bad `kv_connector_extra_config`: the message is one line naming the key."""


@dataclass(frozen=True)
class VllmConnectorConfig:
    """kvstrata's tiers under vLLM: host pages, storage, keys and policies."""

    host_pages: int = doc(0, "host capacity in kvstrata pages (0: derived from host_bytes)")
    host_bytes: int = doc(0, "host capacity in bytes when host_pages is 0 (per vLLM worker)")
    page_size: int = doc(0, "tokens per kvstrata page; 0: vLLM's block size (else a multiple)")
    storage_url: str = doc("", "storage URL (file:///dir, redis://host:port/db); empty: none")
    write_policy: str = doc(
        "write_through",
        "vLLM->host copies: write_through (as computed), write_back (when the request ends),"
        " write_through_selective (once a page was hit write_through_threshold times)",
    )
    write_through_threshold: int = doc(
        2, "write_through_selective: hits of a page before it is copied to host memory"
    )
    prefetch_policy: str = doc(
        "timeout", "storage->host prefetch: best_effort, wait_complete, timeout"
    )
    prefetch_timeout_base_s: float = doc(2.0, "timeout policy: fixed part of the budget (s)")
    prefetch_timeout_per_page_s: float = doc(0.01, "timeout policy: budget added per page (s)")
    eviction: str = doc("lru", "host eviction policy name (lru, lfu)")
    tenant_salt: str = doc("", "salt of every key (a request's cache_salt joins it)")
    model_fingerprint: str = doc("", "identity of the weights in the keys ('' : vLLM's model name)")
    copy_mode: str = doc("auto", "host<->vLLM copies: step, layer or auto (see COPY_MODES)")
    copy_timeout_s: float = doc(
        30.0, "longest wait for one layer's copies (s); past it the step fails naming the layer"
    )
    check_integrity: bool = doc(False, "check the tree and pools after every step (tests)")

    def __post_init__(self) -> None:
        for name in ("host_pages", "host_bytes", "page_size"):
            if getattr(self, name) < 0:
                _bad(name, getattr(self, name), "must be >= 0")
        if not self.host_pages and not self.host_bytes:
            _bad("host_pages", 0, "host_pages or host_bytes must be > 0 (the host pool)")
        if self.write_through_threshold < 1:
            _bad("write_through_threshold", self.write_through_threshold, "must be >= 1")
        policies = (("write_policy", WRITE), ("prefetch_policy", PREFETCH), ("eviction", EVICTION))
        for name, registry in policies:
            try:
                registry.get(getattr(self, name))
            except ValueError as exc:
                raise ConnectorConfigError(f"kv_connector_extra_config[{name!r}]: {exc}") from None
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_page_s"):
            if getattr(self, name) < 0:
                _bad(name, getattr(self, name), "must be >= 0")
        if self.copy_mode not in COPY_MODES:
            _bad("copy_mode", self.copy_mode, f"must be one of {COPY_MODES}")
        if self.copy_timeout_s <= 0:
            _bad("copy_timeout_s", self.copy_timeout_s, "must be > 0")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> VllmConnectorConfig:
        """Build from vLLM's extra config; unknown keys and wrongly typed values are refused."""
        extra = dict(extra or {})
        hints = get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in extra.items():
            if key not in names:
                raise ConnectorConfigError(
                    f"kv_connector_extra_config[{key!r}]: unknown key; known: {', '.join(sorted(names))}"
                )
            extra[key] = _coerce(key, value, hints[key])
        return cls(**extra)

    def layer_copies(self, device_type: str) -> bool:
        """Whether copies run layer by layer for vLLM's KV on this device type."""
        if self.copy_mode == "auto":
            return device_type != "cpu"
        return self.copy_mode == "layer"

    def resolved_host_pages(self, page_nbytes: int) -> int:
        """Host pages: host_pages, or as many whole pages as host_bytes holds."""
        if self.host_pages:
            return self.host_pages
        pages = self.host_bytes // page_nbytes
        if pages < 1:
            _bad("host_bytes", self.host_bytes, f"holds no page of {page_nbytes} bytes")
        return pages

    def host_pool_pages(self, page_nbytes: int) -> int:
        """resolved_host_pages, refused (naming the key and the bytes) where the pool would not
        fit in the memory available now: a worker asks before it allocates its pool."""
        pages = self.resolved_host_pages(page_nbytes)
        key = "host_pages" if self.host_pages else "host_bytes"
        try:
            check_fits(
                [(f"kv_connector_extra_config[{key!r}]", pages * page_nbytes)],
                f"a host pool of {pages:,} pages x {page_nbytes:,} bytes ",
            )
        except ValueError as exc:
            raise ConnectorConfigError(str(exc)) from None
        return pages


def _coerce(key: str, value: Any, tp: Any) -> Any:
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if tp is float and isinstance(value, int | str) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, tp):
        _bad(key, value, f"must be a {tp.__name__}")
    return value


def _bad(key: str, value: Any, why: str) -> None:
    raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] = {value!r}: {why}")

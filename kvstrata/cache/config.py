"""Configuration of the cache layer (tensor-free)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.configtools import doc


@dataclass(frozen=True)
class CacheConfig:
    """Prefix cache: page size, tier capacities and the policies chosen by name."""

    page_size: int = doc(64, "tokens per page: the unit of caching, transfer and storage")
    device_pages: int = doc(256, "device pool capacity in pages")
    host_pages: int = doc(1024, "host pool capacity in pages; 0 disables the host tier")
    storage_url: str = doc(
        "",
        "storage URL (file:///dir, a path, redis://host:port/db, "
        "mooncake://host:rpc_port?metadata=URL&segment=BYTES); empty disables the storage tier",
    )
    eviction: str = doc("lru", "eviction policy name (lru, lfu)")
    write_policy: str = doc(
        "write_through", "device->host backup: write_through, write_through_selective, write_back"
    )
    write_through_threshold: int = doc(2, "hits before write_through_selective backs a page up")
    prefetch_policy: str = doc(
        "timeout", "storage->host prefetch: best_effort, wait_complete, timeout"
    )
    prefetch_timeout_base_s: float = doc(0.2, "timeout policy: fixed part of the budget (seconds)")
    prefetch_timeout_per_page_s: float = doc(
        0.005, "timeout policy: budget added per prefetched page"
    )
    results_per_step: int = doc(8, "completions of each kind agreed and applied per step at most")
    pin_budget: float = doc(
        0.5,
        "fraction of each pool that client pins (cache_control, kv_pin_s) may keep; past it "
        "the oldest pin lets go first",
    )
    max_prefetch_pages: int = doc(
        256, "pages that prefetch hints (POST /v1/kv/prefetch) may have in flight at most"
    )

    def __post_init__(self) -> None:
        for name in ("page_size", "device_pages", "results_per_step", "write_through_threshold"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {self.host_pages}")
        if self.storage_url and not self.host_pages:
            raise ValueError(
                "storage_url needs host_pages > 0: storage pages move through host memory"
            )
        if not 0.0 <= self.pin_budget <= 1.0:
            raise ValueError(f"pin_budget must be in [0, 1], got {self.pin_budget}")
        if self.max_prefetch_pages < 0:
            raise ValueError(f"max_prefetch_pages must be >= 0, got {self.max_prefetch_pages}")
        if self.prefetch_timeout_base_s < 0 or self.prefetch_timeout_per_page_s < 0:
            raise ValueError("prefetch timeouts must be >= 0")

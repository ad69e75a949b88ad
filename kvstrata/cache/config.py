"""Configuration of the cache layer (tensor-free)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvstrata.configtools import doc, require_positive

TIER_SETS = ("none", "device", "device_host", "device_host_storage")
"""Cache configurations: no cache, device only, + host memory, + storage. A config's set follows
from its fields (`CacheConfig.tiers`); `CacheConfig.with_tiers` is the preset that sets them."""


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
    pin_device_share: float = doc(
        0.0,
        "fraction of the device pool that pinned pages keep ahead of unpinned ones, with a host "
        "tier (which keeps every pinned page); past it they leave the device in LRU order with "
        "the others. 0: the device is recency's alone (a pinned page comes back from host memory, "
        "and requests without pins keep the whole device)",
    )
    max_prefetch_pages: int = doc(
        256, "pages that prefetch hints (POST /v1/kv/prefetch) may have in flight at most"
    )
    prefix_cache: bool = doc(
        True,
        "keep computed pages for later requests; off (tiers none, with host_pages 0 and no "
        "storage_url): every prompt is computed from scratch",
        cli=False,  # the command line turns it off with the --tiers none preset
    )

    def __post_init__(self) -> None:
        positive = ("page_size", "device_pages", "results_per_step", "write_through_threshold")
        require_positive(self, *positive)
        if self.host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {self.host_pages}")
        if self.storage_url and not self.host_pages:
            raise ValueError(
                "storage_url needs host_pages > 0: storage pages move through host memory"
            )
        for share in ("pin_budget", "pin_device_share"):
            if not 0.0 <= getattr(self, share) <= 1.0:
                raise ValueError(f"{share} must be in [0, 1], got {getattr(self, share)}")
        if self.max_prefetch_pages < 0:
            raise ValueError(f"max_prefetch_pages must be >= 0, got {self.max_prefetch_pages}")
        if self.prefetch_timeout_base_s < 0 or self.prefetch_timeout_per_page_s < 0:
            raise ValueError("prefetch timeouts must be >= 0")
        if not self.prefix_cache and (self.host_pages or self.storage_url):
            raise ValueError(
                "prefix_cache off (tiers none) needs host_pages 0 and no storage_url, got "
                f"host_pages {self.host_pages}, storage_url {self.storage_url!r}"
            )

    @property
    def tiers(self) -> str:
        """The tier set these fields make (one of TIER_SETS): the one rule from fields to set."""
        if not self.prefix_cache:
            return "none"
        if not self.host_pages:
            return "device"
        return "device_host_storage" if self.storage_url else "device_host"

    def with_tiers(self, tiers: str) -> CacheConfig:
        """This config restricted to the tier set `tiers` (the `--tiers` preset): the fields of
        the tiers left out are cleared; a tier kept must be configured (host_pages > 0,
        storage_url set). `with_tiers(t).tiers == t` for every t in TIER_SETS."""
        if tiers not in TIER_SETS:
            raise ValueError(f"tiers must be one of {', '.join(TIER_SETS)}, got {tiers!r}")
        if tiers in ("none", "device"):
            return replace(self, prefix_cache=tiers == "device", host_pages=0, storage_url="")
        if not self.host_pages:
            raise ValueError(f"tiers {tiers} needs host_pages > 0")
        if tiers == "device_host":
            return replace(self, prefix_cache=True, storage_url="")
        if not self.storage_url:
            raise ValueError("tiers device_host_storage needs --storage-url")
        return replace(self, prefix_cache=True)

"""Per-tier counters of the cache, ready to be exported as metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

TIERS = ("device", "host", "storage")
DIRECTIONS = {
    "load": "host->device",
    "store": "device->host",
    "backup": "host->storage",
    "prefetch": "storage->host",
}


def _zeros(names: tuple[str, ...] | list[str]) -> dict[str, int]:
    return dict.fromkeys(names, 0)


@dataclass
class PinCounts:
    """Monotone pin counters, and the pinned pages per tier as of the last step."""

    made: int = 0
    renewed: int = 0
    expired: int = 0
    dropped_for_budget: int = 0  # older pins that made room for newer ones
    refused_for_budget: int = 0  # pins larger than the whole budget
    lost: int = 0  # pins whose pages had no copy left to keep (vLLM's transit pages)
    pinned_pages: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})


@dataclass
class CacheCounters:
    """Monotone counters; tokens are pages x page size."""

    page_size: int
    page_nbytes: int = 0
    requests: int = 0
    prompt_pages: int = 0
    """Full pages of every admitted prompt."""
    hit_pages: dict[str, int] = field(default_factory=lambda: _zeros(TIERS))
    """Pages of admitted prompts served from each tier (storage: prefetched and used)."""
    pages_moved: dict[str, int] = field(default_factory=lambda: _zeros(list(DIRECTIONS.values())))
    evictions: dict[str, int] = field(default_factory=lambda: _zeros(("device", "host")))
    """Pages that left a tier to make room."""
    lost_pages: int = 0
    """Pages whose last copy left the cache while storage held none of them: a prompt that
    needs them again computes them."""
    prefetch: dict[str, int] = field(
        default_factory=lambda: _zeros(("complete", "partial", "empty", "stopped"))
    )
    """Prefetch outcomes: every page arrived, some, none; stopped early by the policy."""
    prefetch_no_room_pages: int = 0
    """Pages storage held for a prompt that no reload read: host memory had no room for them."""
    failed_pages: dict[str, int] = field(default_factory=lambda: _zeros(list(DIRECTIONS.values())))
    unwritten_bytes: int = 0
    """Bytes of backed-up pages that storage held already (kept, not written): not moved."""
    pins: PinCounts = field(default_factory=PinCounts)
    """Client pins (cache/pins.py): made, renewed, expired, dropped or refused for budget."""

    def record_request(self, prompt_pages: int, device: int, host: int, storage: int) -> None:
        self.requests += 1
        self.prompt_pages += prompt_pages
        self.hit_pages["device"] += device
        self.hit_pages["host"] += host
        self.hit_pages["storage"] += storage

    def record_move(self, kind: str, asked: int, ok: int, written_bytes: int | None = None) -> None:
        """`ok` of `asked` pages moved; written_bytes (backup): what storage actually wrote."""
        direction = DIRECTIONS[kind]
        self.pages_moved[direction] += ok
        self.failed_pages[direction] += asked - ok
        if written_bytes is not None:
            self.unwritten_bytes += max(0, ok * self.page_nbytes - written_bytes)

    @property
    def bytes_moved(self) -> dict[str, int]:
        out = {d: n * self.page_nbytes for d, n in self.pages_moved.items()}
        out[DIRECTIONS["backup"]] -= self.unwritten_bytes
        return out

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_pages.values()) / self.prompt_pages if self.prompt_pages else 0.0

    def hit_rate_by_tier(self) -> dict[str, float]:
        total = self.prompt_pages or 1
        return {t: n / total for t, n in self.hit_pages.items()}

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_tokens"] = {t: n * self.page_size for t, n in self.hit_pages.items()}
        out["bytes_moved"] = self.bytes_moved
        out["hit_rate"] = self.hit_rate
        out["hit_rate_by_tier"] = self.hit_rate_by_tier()
        return out

"""Per-tier counters of the cache, ready to be exported as metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

TIERS = ("L1", "L2", "L3")
DIRECTIONS = {"load": "L2->L1", "store": "L1->L2", "backup": "L2->L3", "prefetch": "L3->L2"}


def _zeros(names: tuple[str, ...] | list[str]) -> dict[str, int]:
    return dict.fromkeys(names, 0)


@dataclass
class CacheCounters:
    """Monotone counters; tokens are pages x page size."""

    page_size: int
    page_nbytes: int = 0
    requests: int = 0
    prompt_pages: int = 0
    """Full pages of every admitted prompt."""
    hit_pages: dict[str, int] = field(default_factory=lambda: _zeros(TIERS))
    """Pages of admitted prompts served from each tier (L3: prefetched and used)."""
    pages_moved: dict[str, int] = field(default_factory=lambda: _zeros(list(DIRECTIONS.values())))
    evictions: dict[str, int] = field(default_factory=lambda: _zeros(("L1", "L2")))
    """Pages that left a tier to make room."""
    prefetch: dict[str, int] = field(
        default_factory=lambda: _zeros(("complete", "partial", "empty", "stopped"))
    )
    """Prefetch outcomes: every page arrived, some, none; stopped early by the policy."""
    failed_pages: dict[str, int] = field(default_factory=lambda: _zeros(list(DIRECTIONS.values())))

    def record_request(self, prompt_pages: int, l1: int, l2: int, l3: int) -> None:
        self.requests += 1
        self.prompt_pages += prompt_pages
        self.hit_pages["L1"] += l1
        self.hit_pages["L2"] += l2
        self.hit_pages["L3"] += l3

    def record_move(self, kind: str, asked: int, ok: int) -> None:
        direction = DIRECTIONS[kind]
        self.pages_moved[direction] += ok
        self.failed_pages[direction] += asked - ok

    @property
    def bytes_moved(self) -> dict[str, int]:
        return {d: n * self.page_nbytes for d, n in self.pages_moved.items()}

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

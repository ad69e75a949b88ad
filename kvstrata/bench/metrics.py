"""Prometheus exposition of the cache's per-tier counters (prometheus_client).

`CacheCollector(cache)` reads the counters at scrape time, so nothing is copied on the serving
path; register it on a CollectorRegistry and serve it with prometheus_client's HTTP server.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.cache.hicache import HiCache


class CacheCollector(Collector):
    """kvstrata_* metrics of one HiCache."""

    def __init__(self, cache: HiCache, prefix: str = "kvstrata") -> None:
        self.cache, self.prefix = cache, prefix

    def collect(self) -> Iterator[Metric]:
        c, p = self.cache.counters, self.prefix
        hits = CounterMetricFamily(
            f"{p}_hit_tokens", "prompt tokens served from a tier", labels=["tier"]
        )
        for tier, pages in c.hit_pages.items():
            hits.add_metric([tier], pages * c.page_size)
        yield hits
        yield CounterMetricFamily(
            f"{p}_prompt_tokens",
            "tokens of admitted prompts (full pages)",
            value=c.prompt_pages * c.page_size,
        )
        moved = CounterMetricFamily(
            f"{p}_moved_bytes", "bytes copied between tiers", labels=["direction"]
        )
        for direction, nbytes in c.bytes_moved.items():
            moved.add_metric([direction], nbytes)
        yield moved
        evicted = CounterMetricFamily(
            f"{p}_evicted_pages", "pages evicted from a tier", labels=["tier"]
        )
        for tier, pages in c.evictions.items():
            evicted.add_metric([tier], pages)
        yield evicted
        prefetch = CounterMetricFamily(
            f"{p}_prefetches", "storage prefetch outcomes", labels=["outcome"]
        )
        for outcome, n in c.prefetch.items():
            prefetch.add_metric([outcome], n)
        yield prefetch
        pages = GaugeMetricFamily(
            f"{p}_pool_pages", "pool pages by state", labels=["pool", "state"]
        )
        for pool, parts in self.cache.accounting().items():
            for state, n in parts.items():
                pages.add_metric([pool, state], n)
        yield pages

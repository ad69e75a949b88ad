"""The Prometheus exposition reflects the cache's counters after real requests."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.bench.metrics import CacheCollector
from tests.cache_harness import make_cache, serve


def test_exposition_counts_hits_and_pool_states() -> None:
    cache, mover = make_cache(device=8, host=16, storage=False)
    keys = [(7 << 16) | i for i in range(6)]
    serve(cache, mover, keys)
    cache.drain()
    serve(cache, mover, keys)
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    text = generate_latest(registry).decode()
    assert (
        'kvstrata_hit_tokens_total{tier="device"} 24.0' in text
    )  # 6 pages x 4 tokens, second time
    assert 'kvstrata_moved_bytes_total{direction="device->host"} 48.0' in text  # 6 pages x 8 bytes
    free = cache.accounting()["device"]["free"]
    assert f'kvstrata_pool_pages{{pool="device",state="free"}} {float(free)}' in text

"""Client pins in the tensor-free cache: survival under eviction, TTL on the step clock, the budget."""

from __future__ import annotations

import pytest

from kvstrata.cache.hicache import HiCache
from kvstrata.cache.lease import Lease
from kvstrata.cache.pins import PinSpec
from tests.cache_harness import ArrayMover, content, make_cache, serve

PAGE = 4  # make_cache's page size


def seq(name: int, pages: int) -> list[int]:
    return [(name << 16) | i for i in range(pages)]


def serve_pinned(
    cache: HiCache, mover: ArrayMover, keys: list[int], pin_pages: int, ttl_s: float = 300.0
) -> tuple[tuple[int, int, int], int]:
    """One request through its lease asking to pin its first `pin_pages` pages; returns (hits
    per tier, pages pinned)."""
    lease = Lease(cache, keys, len(keys) * PAGE + 1, len(keys), PAGE)
    lease.want_pins([PinSpec(pin_pages * PAGE, ttl_s)])
    assert lease.advance(cache.pins.now_s, can_schedule=True)
    if not lease.admit():  # its room frees once a demotion copy lands: a later step admits it
        cache.drain()
        assert lease.admit()
    cache.drain()
    hit = lease.page_table[: lease.hits.pages]
    assert [int(x) for x in mover.device[hit]] == [content(k) for k in keys[: len(hit)]]
    mover.device[lease.page_table[len(hit) :]] = [content(k) for k in keys[len(hit) :]]
    lease.commit(len(keys) * PAGE)
    lease.release()
    cache.drain()
    cache.check_integrity()
    h = lease.hits
    return (h.device, h.host, h.storage), lease.pinned_pages


def storm(cache: HiCache, mover: ArrayMover, first: int, n: int, pages: int) -> None:
    """n requests of fresh pages, each needing most of the device."""
    for name in range(first, first + n):
        serve(cache, mover, seq(name, pages))
        cache.drain()
        cache.check_integrity()


def pinned_prefixes(cache: HiCache) -> list[list[int]]:
    return sorted(cache.tree.path_keys(p.node) for p in cache.pins.pins.values())


@pytest.mark.parametrize("host", [16, 0])
def test_pinned_prefix_survives_a_storm_that_takes_every_unpinned_page(host: int) -> None:
    cache, mover = make_cache(device=16, host=host, storage=False)
    a = seq(1, 6)
    assert serve_pinned(cache, mover, a, 6) == ((0, 0, 0), 6)
    storm(cache, mover, 100, 12, 8)
    for name in range(100, 108):  # every earlier storm page is gone from every tier
        assert cache.match(seq(name, 8)).pages == 0
    assert cache.match(a).pages == 6
    cache.tick(1.0)  # the per-tier figures are taken at each step
    # the host tier keeps them; without one the device does (the unpinned pages were enough
    # for every storm request)
    assert cache.counters.pins.pinned_pages == {"device": 0 if host else 6, "host": host and 6}
    hits, pinned = serve_pinned(cache, mover, a, 6)  # content checked: the kept bytes are a's
    assert sum(hits) == 6 and pinned == 6
    assert cache.counters.pins.renewed >= 1


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_pinned_pages_keep_the_device_up_to_their_device_share(share: float) -> None:
    """Past `pin_device_share` pinned pages leave the device in LRU order with the unpinned
    ones (the host tier keeps them); within it the device keeps them ahead of the others."""
    cache, mover = make_cache(device=16, host=32, storage=False, pin_device_share=share)
    a = seq(1, 6)
    serve_pinned(cache, mover, a, 6)
    storm(cache, mover, 100, 4, 8)  # newer pages than a's: recency alone would evict a's
    kept = 6 if share else 0  # 6 of the share's 8 device pages
    assert (cache.match(a).device_pages, cache.match(a).host_pages) == (kept, 6 - kept)
    assert serve_pinned(cache, mover, a, 6)[0] == (kept, 6 - kept, 0)


def test_ttl_expiry_on_the_step_clock_lets_the_prefix_go() -> None:
    cache, mover = make_cache(device=16, host=16, storage=False)
    cache.tick(1000.0)  # the injected step clock
    a = seq(1, 6)
    assert serve_pinned(cache, mover, a, 6, ttl_s=300.0)[1] == 6
    cache.tick(1299.0)
    storm(cache, mover, 100, 6, 8)
    assert cache.match(a).pages == 6 and cache.counters.pins.expired == 0
    cache.tick(1300.0)  # deadline reached
    assert cache.counters.pins.expired == 1 and not cache.pins.pins
    assert cache.counters.pins.pinned_pages == {"device": 0, "host": 0}
    storm(cache, mover, 200, 6, 8)
    assert cache.match(a).pages == 0
    cache.check_integrity()


def test_a_hit_renews_the_ttl() -> None:
    cache, mover = make_cache(device=16, host=16, storage=False)
    a = seq(1, 6)
    serve_pinned(cache, mover, a, 6, ttl_s=300.0)  # pinned at t=0: deadline 300
    cache.tick(200.0)
    serve(cache, mover, a)  # a plain hit on the pinned prefix: deadline 500
    cache.tick(450.0)
    assert len(cache.pins.pins) == 1 and cache.counters.pins.expired == 0
    cache.tick(500.0)
    assert not cache.pins.pins and cache.counters.pins.expired == 1


def test_budget_drops_the_oldest_pin_first_and_refuses_a_pin_over_it() -> None:
    cache, mover = make_cache(device=16, host=16, storage=False)  # budget: 8 host pages
    a, b, c = seq(1, 4), seq(2, 4), seq(3, 4)
    for t, keys in enumerate((a, b)):
        cache.tick(float(t))
        assert serve_pinned(cache, mover, keys, 4)[1] == 4
    cache.tick(2.0)
    serve_pinned(cache, mover, a, 4)  # renewed: b is now the oldest
    cache.tick(3.0)
    assert serve_pinned(cache, mover, c, 4)[1] == 4
    assert pinned_prefixes(cache) == sorted([a, c])
    assert cache.counters.pins.dropped_for_budget == 1
    assert serve_pinned(cache, mover, seq(4, 9), 9)[1] == 0  # 9 > the whole budget
    assert cache.counters.pins.refused_for_budget == 1
    assert pinned_prefixes(cache) == sorted([a, c]) and cache.pins.pinned == 8


def test_nested_pins_share_pages_and_count_them_once() -> None:
    cache, mover = make_cache(device=16, host=16, storage=False)
    turn2 = seq(1, 7)
    serve_pinned(cache, mover, turn2[:3], 3)
    serve_pinned(cache, mover, turn2, 7)  # the longer history: 4 more pages
    assert cache.pins.pinned == 7 and len(cache.pins.pins) == 2
    cache.check_integrity()


def test_pins_never_keep_a_request_from_the_device() -> None:
    """Pinned device copies give way (their host copies stay) to a request needing the whole
    device; the pinned prefix is still a hit afterwards."""
    cache, mover = make_cache(device=8, host=16, storage=False)
    a = seq(1, 4)
    serve_pinned(cache, mover, a, 4)
    assert serve(cache, mover, seq(2, 8)) == (0, 0, 0)  # needs all 8 device pages
    cache.drain()
    m = cache.match(a)
    assert (m.device_pages, m.host_pages) == (0, 4)
    assert serve_pinned(cache, mover, a, 4)[0] == (0, 4, 0)


def test_a_hint_load_takes_no_pinned_device_page() -> None:
    cache, mover = make_cache(device=8, host=16, storage=False)
    serve_pinned(cache, mover, seq(1, 4), 4)
    serve(cache, mover, seq(2, 4))
    cache.drain()
    assert cache.tiers.alloc_device(6, spare_pinned=True) is None  # only 4 unpinned pages
    ids = cache.tiers.alloc_device(4, spare_pinned=True)
    assert ids is not None and cache.match(seq(1, 4)).device_pages == 4
    cache.tiers.device.free(ids)
    cache.check_integrity()


def test_reset_forgets_pins() -> None:
    cache, mover = make_cache(device=8, host=16, storage=False)
    serve_pinned(cache, mover, seq(1, 4), 4)
    assert cache.reset_prefix(drop_host=True)
    assert not cache.pins.pins and cache.pins.pinned == 0
    cache.check_integrity()


def test_pin_spec_rejects_a_bad_ttl() -> None:
    with pytest.raises(ValueError, match="7200"):
        PinSpec(64, 7200.0)


def test_a_pinned_page_without_a_host_copy_gives_way_by_demotion() -> None:
    """write_back: the pinned pages have no host copy; a request needing the whole device
    demotes them to the host tier (which keeps them pinned) instead of waiting for ever."""
    cache, mover = make_cache(device=8, host=16, storage=False, write_policy="write_back")
    a = seq(1, 4)
    serve_pinned(cache, mover, a, 4)
    assert cache.match(a).device_pages == 4 and cache.counters.pages_moved["device->host"] == 0
    assert serve(cache, mover, seq(2, 8)) == (0, 0, 0)
    cache.drain()
    m = cache.match(a)
    assert (m.device_pages, m.host_pages) == (0, 4) and cache.pins.pinned == 4
    assert serve_pinned(cache, mover, a, 4)[0] == (0, 4, 0)  # content checked

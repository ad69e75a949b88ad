"""The hierarchical cache manager: tiers, policies, counted completions, integrity after every step."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.cache.hicache import HiCache
from kvstrata.cache.lease import Lease, LeaseState
from kvstrata.cache.ops import KINDS, NOT_DONE, STORE, OpQueues, TransferOp
from tests.cache_harness import ArrayMover, content, make_cache, serve

PREFIXES = [[(p << 16) | i for i in range(12)] for p in range(4)]


def seq(prefix: int, cut: int, tail: int, length: int) -> list[int]:
    """Prefix `prefix` up to `cut`, then a branch named by `tail`."""
    return PREFIXES[prefix][:cut] + [(1 << 40) | (tail << 8) | i for i in range(length)]


def test_demote_to_host_and_load_back() -> None:
    cache, mover = make_cache(device=8, host=16, storage=False)
    a, b = seq(0, 6, 1, 0), seq(1, 6, 2, 0)
    assert serve(cache, mover, a) == (0, 0, 0)
    cache.drain()
    # b needs 6 of the 8 pages: only 4 of a's go, tail first (write_through backed them up)
    assert serve(cache, mover, b) == (0, 0, 0)
    cache.drain()
    cache.check_integrity()
    m = cache.match(a)
    assert m.device_pages == 2 and m.host_pages == 4
    assert serve(cache, mover, a) == (2, 4, 0)
    assert cache.counters.pages_moved["host->device"] == 4


def test_storage_roundtrip_in_a_fresh_cache_sharing_storage() -> None:
    cache, mover = make_cache(device=8, host=8)
    a = seq(2, 8, 3, 0)
    serve(cache, mover, a)
    cache.drain()
    assert set(a) <= set(mover.storage)
    fresh, mover2 = make_cache(device=8, host=8)
    mover2.storage = mover.storage  # a new process reading the same store
    assert serve(fresh, mover2, a) == (0, 0, 8)
    assert fresh.counters.prefetch["complete"] == 1
    fresh.check_integrity()


def test_write_back_only_copies_on_eviction() -> None:
    cache, mover = make_cache(device=4, host=8, storage=False, write_policy="write_back")
    serve(cache, mover, seq(0, 4, 0, 0))
    cache.drain()
    assert cache.counters.pages_moved["device->host"] == 0
    serve(cache, mover, seq(1, 4, 0, 0))  # needs device memory: demote the first four pages
    cache.drain()
    assert cache.counters.pages_moved["device->host"] == 4
    assert serve(cache, mover, seq(0, 4, 0, 0)) == (0, 4, 0)


def test_selective_backs_up_after_n_hits() -> None:
    cache, mover = make_cache(
        device=8,
        host=8,
        storage=False,
        write_policy="write_through_selective",
        write_through_threshold=2,
    )
    a = seq(0, 4, 0, 0)
    serve(cache, mover, a)
    cache.drain()
    assert cache.counters.pages_moved["device->host"] == 0
    serve(cache, mover, a)
    serve(cache, mover, a)
    cache.drain()
    assert cache.counters.pages_moved["device->host"] == 4


def test_late_completions_wait_for_agreement() -> None:
    cache, mover = make_cache(device=8, host=8, storage=False, max_delay=0)
    serve(cache, mover, seq(0, 4, 0, 0))  # a store is pending
    progress = cache.local_progress()
    assert max(progress) >= 0  # done locally
    agreed = [-1] * len(progress)  # another rank has not finished
    assert cache.apply(agreed) == []
    assert cache.match(seq(0, 4, 0, 0)).last_node.host is None  # not applied: no host copy yet
    assert len(cache.apply(progress)) == 1
    cache.check_integrity()


def _reading(cache: HiCache, mover: ArrayMover, keys: list[int], polls: int) -> Lease:
    """A lease whose pages all wait in storage, its read from storage under way and done only
    after `polls` more polls."""
    page = cache.config.page_size
    lease = Lease(cache, keys, len(keys) * page + 1, len(keys), page)
    assert not lease.advance(0.0, can_schedule=False)  # probing
    while lease.state is LeaseState.PROBING:
        assert cache.step() and not lease.advance(0.0, can_schedule=False)
    assert lease.state is LeaseState.PREFETCHING and lease.prefetch is not None
    mover.wait[id(lease.prefetch)] = polls
    return lease


def test_a_short_storage_read_lands_before_a_long_one_queued_ahead() -> None:
    cache, mover = make_cache(device=16, host=16)
    long, short = seq(0, 8, 1, 0), seq(1, 3, 2, 0)
    mover.storage.update({k: content(k) for k in long + short})
    first = _reading(cache, mover, long, polls=6)  # polled once as the short one's probe lands
    second = _reading(cache, mover, short, polls=0)
    assert cache.step() == [second.prefetch]  # applied at once, not after the long one
    cache.check_integrity()
    assert not first.advance(0.0, can_schedule=False)  # still reading
    assert second.advance(0.0, can_schedule=False) and second.match.host_pages == 3
    assert second.admit() and second.hits.storage == 3
    for _ in range(4):  # the short request's host -> device load lands meanwhile
        assert first.prefetch not in cache.step()
    assert cache.step() == [first.prefetch]
    cache.check_integrity()
    assert first.advance(0.0, can_schedule=False) and first.match.host_pages == 8
    assert cache.counters.prefetch["complete"] == 2


def test_copies_apply_in_the_order_they_were_submitted() -> None:
    mover, queues = ArrayMover(4, 4), OpQueues(per_step=2)
    ops = [TransferOp(STORE, [i], [i]) for i in range(2)]
    for op in ops:
        queues.add(op)
        mover.submit(op)
    mover.wait[id(ops[0])], mover.wait[id(ops[1])] = 3, 0  # the second is done first
    progress = queues.local_progress(mover)
    at = KINDS.index(STORE) * 2
    assert progress[at : at + 2] == [NOT_DONE, NOT_DONE]  # the second waits for the first
    assert queues.take_agreed(progress) == []
    for _ in range(2):
        queues.local_progress(mover)
    assert [op for op, _ in queues.take_agreed(queues.local_progress(mover))] == ops


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(0, 12),
            st.integers(0, 5),
            st.integers(0, 6),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=30,
    ),
    device=st.integers(6, 24),
    host=st.integers(0, 40),
    storage=st.booleans(),
    policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    eviction=st.sampled_from(["lru", "lfu"]),
    delay=st.integers(0, 3),
)
def test_random_requests_against_reference(
    ops: list[tuple[int, int, int, int, int]],
    device: int,
    host: int,
    storage: bool,
    policy: str,
    eviction: str,
    delay: int,
) -> None:
    cache, mover = make_cache(
        device,
        host,
        storage=storage and host > 0,
        max_delay=delay,
        seed=len(ops),
        write_policy=policy,
        eviction=eviction,
    )
    seen: set[int] = set()  # naive reference: every page ever computed
    rng = random.Random(device)
    for prefix, cut, tail, length, steps in ops:
        keys = seq(prefix, cut, tail, length)[: device - 1]
        hits = serve(cache, mover, keys)
        cached = [k for k in keys[: sum(hits)]]
        assert set(cached) <= seen, "a page was served that was never computed"
        seen.update(keys)
        for _ in range(steps + rng.randint(0, 1)):
            cache.step()
            cache.check_integrity()
        # every page the tree names holds its own content, on every tier
        for node in cache.tree.nodes():
            path = cache.tree.path_keys(node)[-len(node) :]
            want = [content(k) for k in path]
            if node.device is not None and not set(node.device) & set(
                cache.queues.inflight_ids("load", "dst")
            ):
                assert [int(x) for x in mover.device[node.device]] == want
            if node.host is not None:
                assert [int(x) for x in mover.host[node.host]] == want
        cache.check_integrity()
    cache.drain()
    cache.check_integrity()


def test_unbounded_capacity_hits_everything_seen() -> None:
    cache, mover = make_cache(device=400, host=400)
    seen: set[int] = set()
    rng = random.Random(7)
    for _ in range(60):
        keys = seq(rng.randrange(4), rng.randrange(13), rng.randrange(3), rng.randrange(5))
        expect = 0
        while expect < len(keys) and keys[expect] in seen:
            expect += 1
        assert sum(serve(cache, mover, keys)) == expect  # infinite capacity: exactly the reference
        seen.update(keys)
        cache.step()
        cache.check_integrity()


def test_drain_applies_only_what_the_agreement_allows() -> None:
    """The one drain loop: ops land through the agreement it is given; one that never agrees
    ends in a TimeoutError naming what waited and how many copies are still pending."""
    cache, mover = make_cache(device=8, host=8, storage=False, max_delay=0)
    serve(cache, mover, seq(0, 4, 0, 0))  # a store is pending
    calls: list[list[int]] = []

    def never(local: list[int]) -> list[int]:
        calls.append(local)
        return [-1] * len(local)  # another rank has not finished

    try:
        cache.drain(never, timeout_s=0.05, what="test drain")
    except TimeoutError as exc:
        assert str(exc) == "test drain: 1 cache copies still pending after 0.05 s"
    else:
        raise AssertionError("a drain that never agrees must time out")
    assert calls and len(cache.queues) == 1
    seen: list[list[int]] = []
    cache.drain(lambda local: seen.append(local) or local)  # agreed: it lands
    assert len(cache.queues) == 0 and len(seen) >= 1
    assert cache.match(seq(0, 4, 0, 0)).last_node.host is not None
    cache.check_integrity()


def test_a_reload_larger_than_host_memory_reads_its_leading_pages() -> None:
    """Storage holds 8 pages, host memory has room for 3: the reload reads the 3 leading
    pages (each one read is one less to compute), and says how many it left."""
    cache, mover = make_cache(device=16, host=16)
    a = seq(2, 8, 3, 0)
    serve(cache, mover, a)
    cache.drain()
    small, mover2 = make_cache(device=16, host=3)
    mover2.storage = mover.storage  # a new process reading the same store
    assert serve(small, mover2, a) == (0, 0, 3)  # serve checks each page's content
    assert small.counters.prefetch_no_room_pages == 5
    assert small.counters.prefetch["complete"] == 1
    small.drain()
    small.check_integrity()


def hold(cache: HiCache, keys: list[int], cached: int) -> Lease:
    """A request that keeps `keys` while others run: admitted (its first `cached` pages hit
    the device), not released."""
    page = cache.config.page_size
    lease = Lease(cache, keys, len(keys) * page + 1, len(keys), page)
    while not lease.advance(0.0, can_schedule=False):
        cache.step()
    assert lease.admit() and lease.hits.device == cached
    return lease


def test_a_held_page_gives_up_its_host_copy_once_storage_has_it() -> None:
    """Host memory is nearly full of a running request's pages: their host copies go (storage
    and the device hold them) so the next prompt's pages get theirs; not without storage. The
    holder's next page gets a host copy, and a page that gave its copy up does not take one
    back while held."""
    for storage in (True, False):
        cache, mover = make_cache(device=12, host=6, storage=storage)
        a, b, extra = seq(0, 4, 0, 0), seq(1, 4, 0, 0), seq(0, 5, 0, 0)[4]
        serve(cache, mover, a)
        cache.drain()
        held = hold(cache, a + [extra], cached=4)
        serve(cache, mover, b)
        cache.drain()
        cache.check_integrity()
        ma, mb = cache.match(a), cache.match(b)
        assert ma.device_pages == 4 and mb.device_pages == 4
        assert (ma.last_node.host is None) == storage  # a's copy gave way only to storage
        assert (mb.last_node.host is not None) == storage
        copied = cache.counters.pages_moved["device->host"]
        mover.device[held.page_table[4]] = content(extra)
        held.commit(5 * cache.config.page_size)  # the holder computed one more page
        cache.drain()
        cache.check_integrity()
        assert cache.counters.pages_moved["device->host"] == copied + 1  # the new page only
        assert (cache.match(a).last_node.host is None) == storage
        assert cache.counters.lost_pages == 0
        held.release()
        cache.check_integrity()


def test_lost_pages_count_the_pages_no_tier_or_storage_keeps() -> None:
    """Without storage a dropped page is lost; with storage it can be read again."""
    for storage, lost in ((False, 8), (True, 0)):
        cache, mover = make_cache(device=4, host=4, storage=storage)
        for prefix in range(3):  # each prompt's host copies push out the one before it
            serve(cache, mover, seq(prefix, 4, 0, 0))
            cache.drain()
            cache.check_integrity()
        assert cache.counters.lost_pages == lost

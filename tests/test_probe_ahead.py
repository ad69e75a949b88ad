"""A storage probe asked before the step's agreement (Lease.probe_ahead): the match made after
the step's moves uses its answer wherever the answer covers where that match ends, and asks
storage again where it does not. Exact page counts; integrity after every step."""

from __future__ import annotations

from kvstrata.cache.hicache import HiCache
from kvstrata.cache.lease import Lease, LeaseState
from kvstrata.cache.ops import PROBE, TransferOp
from tests.cache_harness import ArrayMover, content, make_cache, serve

PAGE = 4
HISTORY = [(7 << 16) | i for i in range(8)]  # one request's 8 full pages, by key


def lease_for(cache: HiCache, keys: list[int]) -> Lease:
    """A request of `keys` full pages and one token more (every page may hit)."""
    return Lease(cache, keys, len(keys) * PAGE + 1, len(keys) + 1, PAGE)


def stored(mover: ArrayMover, keys: list[int]) -> None:
    mover.storage.update({k: content(k) for k in keys})


def probes_put(cache: HiCache) -> list[TransferOp]:
    return list(cache.queues.pending[PROBE])


def step(cache: HiCache) -> None:
    cache.step()
    cache.check_integrity()


def until_ready(cache: HiCache, lease: Lease) -> int:
    """Steps until the lease may be admitted; returns how many it took."""
    steps = 0
    while not lease.advance(0.0, can_schedule=False):
        step(cache)
        steps += 1
        assert steps < 50, f"lease still {lease.state.value}"
    return steps


def admitted_hits(cache: HiCache, lease: Lease) -> tuple[int, int, int]:
    """Steps the lease to READY, admits it and lets go: its (device, host, storage) hits."""
    until_ready(cache, lease)
    assert lease.admit()
    hits = (lease.hits.device, lease.hits.host, lease.hits.storage)
    lease.release()
    cache.check_integrity()
    return hits


def test_an_answer_that_came_with_the_step_is_used_at_once() -> None:
    cache, mover = make_cache(device=16, host=16)
    stored(mover, HISTORY)
    lease = lease_for(cache, HISTORY)
    probe = lease.probe_ahead()
    assert probe is not None and probe.keys == HISTORY and lease.state is LeaseState.NEW
    assert cache.tree.root.children == {}  # nothing matched, locked or touched
    step(cache)  # the step's agreement carries the answer
    assert probe.agreed == 8
    assert not lease.advance(0.0, can_schedule=False)
    assert lease.state is LeaseState.PREFETCHING and lease.prefetch is not None
    assert lease.prefetch.keys == HISTORY and probes_put(cache) == []  # no second probe
    assert until_ready(cache, lease) == 1 and lease.admit()
    assert (lease.hits.device, lease.hits.host, lease.hits.storage) == (0, 0, 8)
    assert lease.probe_ahead() is None  # once per lease, and only before its match
    lease.release()
    cache.check_integrity()


def test_a_match_that_grew_within_the_answer_reads_only_the_rest() -> None:
    cache, mover = make_cache(device=16, host=16)
    stored(mover, HISTORY)
    lease = lease_for(cache, HISTORY)
    probe = lease.probe_ahead()
    assert probe is not None and lease.probe_from == 0
    assert serve(cache, mover, HISTORY[:3]) == (0, 0, 3)  # another request: 3 pages on device
    step(cache)
    assert not lease.advance(0.0, can_schedule=False)
    assert lease.match is not None and lease.match.pages == 3
    assert lease.prefetch is not None and lease.prefetch.keys == HISTORY[3:]  # 8 - 3 = 5
    assert probes_put(cache) == []
    assert admitted_hits(cache, lease) == (3, 0, 5)


def test_a_match_past_the_answers_end_asks_storage_again() -> None:
    cache, mover = make_cache(device=16, host=16)
    stored(mover, HISTORY[:2] + HISTORY[4:6])  # pages 0, 1, then 4, 5: not 2 or 3
    lease = lease_for(cache, HISTORY)
    probe = lease.probe_ahead()
    step(cache)
    assert probe is not None and probe.agreed == 2
    mover.storage.clear()  # a request computes pages 0-3 itself (nothing read from storage)
    serve(cache, mover, HISTORY[:4])
    stored(mover, HISTORY[:2] + HISTORY[4:6])
    assert not lease.advance(0.0, can_schedule=False)  # match ends at 4: past page 2
    again = probes_put(cache)
    assert lease.state is LeaseState.PROBING and [op.keys for op in again] == [HISTORY[4:]]
    assert admitted_hits(cache, lease) == (4, 0, 2)


def test_a_pending_answer_is_judged_against_the_match_once_it_comes() -> None:
    cache, mover = make_cache(device=16, host=16)
    stored(mover, HISTORY)
    lease = lease_for(cache, HISTORY)
    probe = lease.probe_ahead()
    assert probe is not None
    mover.wait[id(probe)] = 3  # answered only at the third step from now
    serve(cache, mover, HISTORY[:2])  # 2 pages to device meanwhile (two steps poll the probe)
    assert not lease.advance(0.0, can_schedule=False)
    assert lease.state is LeaseState.PROBING and lease.probe is probe  # adopted, still pending
    step(cache)
    assert probe.agreed == 8 and not lease.advance(0.0, can_schedule=False)
    assert lease.prefetch is not None and lease.prefetch.keys == HISTORY[2:]
    assert probes_put(cache) == []
    assert admitted_hits(cache, lease) == (2, 0, 6)


def test_a_match_that_shrank_asks_storage_again() -> None:
    cache, mover = make_cache(device=16, host=16)
    stored(mover, HISTORY)
    serve(cache, mover, HISTORY[:4])
    cache.drain()
    lease = lease_for(cache, HISTORY)
    probe = lease.probe_ahead()
    assert probe is not None and lease.probe_from == 4 and probe.keys == HISTORY[4:]
    step(cache)
    assert probe.agreed == 4
    assert cache.reset_prefix(drop_host=True)  # the 4 cached pages are forgotten
    assert not lease.advance(0.0, can_schedule=False)
    assert [op.keys for op in probes_put(cache)] == [HISTORY]  # from page 0 now
    assert admitted_hits(cache, lease) == (0, 0, 8)

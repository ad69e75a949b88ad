"""PageAllocator: exact id sequences, round-robin balance, all-or-nothing, determinism, errors."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.memory.allocator import PageAllocator


def test_single_shard_hands_out_ids_in_order_and_reuses_freed_ids_fifo() -> None:
    a = PageAllocator(8)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(2) == [3, 4]
    a.free([1, 3])
    assert (a.num_free, a.num_used) == (5, 3)
    assert a.alloc(4) == [5, 6, 7, 1]  # freed ids go to the back of the free list
    assert a.alloc(1) == [3]
    assert a.alloc(1) is None
    a.check_integrity()


def test_ids_round_robin_over_shards_with_a_cursor_that_persists_across_calls() -> None:
    a = PageAllocator(12, n_shards=3)
    assert a.alloc(4) == [
        0,
        1,
        2,
        3,
    ]  # shard 0 slot 0, shard 1 slot 0, shard 2 slot 0, shard 0 slot 1
    assert a.alloc(1) == [4]  # cursor continues at shard 1
    assert [a.alloc(1)[0] % 3 for _ in range(6)] == [2, 0, 1, 2, 0, 1]  # decode: one page at a time
    assert a.owner(7) == 1 and a.slot(7) == 2
    a.check_integrity()


def test_one_sequence_is_balanced_over_owners() -> None:
    a = PageAllocator(64, n_shards=4)
    a.alloc(3)
    ids = a.alloc(10)
    assert ids is not None
    counts = Counter(i % 4 for i in ids)
    assert max(counts.values()) - min(counts.values()) <= 1
    assert sum(counts.values()) == 10


def test_an_empty_shard_is_skipped_deterministically() -> None:
    a = PageAllocator(4, n_shards=2)
    assert a.alloc(4) == [0, 1, 2, 3]
    a.free([0, 2])  # only shard 0 has free slots
    assert a.num_free_in(0) == 2 and a.num_free_in(1) == 0
    assert a.alloc(2) == [0, 2]
    a.check_integrity()


def test_alloc_is_all_or_nothing() -> None:
    a = PageAllocator(6, n_shards=2)
    a.alloc(4)
    assert a.alloc(3) is None
    assert a.num_free == 2
    assert a.alloc(0) == []
    assert sorted(a.alloc(2) or []) == [4, 5]
    a.check_integrity()


def _replay(seed: int) -> list[object]:
    rng = random.Random(seed)
    a = PageAllocator(40, n_shards=4)
    used: list[int] = []
    out: list[object] = []
    for _ in range(200):
        if used and rng.random() < 0.5:
            rng.shuffle(used)
            k = rng.randint(1, len(used))
            a.free(used[:k])
            del used[:k]
        else:
            ids = a.alloc(rng.randint(0, 12))
            out.append(ids)
            used += ids or []
    return out


def test_two_instances_with_the_same_calls_give_the_same_ids() -> None:
    assert _replay(7) == _replay(7)
    assert _replay(7) != _replay(8)  # the check above can fail


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": -4}, "capacity"),
        ({"capacity": 2.0}, "capacity"),
        ({"capacity": True}, "capacity"),
        ({"capacity": 8, "n_shards": 0}, "n_shards"),
        ({"capacity": 9, "n_shards": 2}, "multiple of n_shards"),
    ],
)
def test_bad_construction_names_the_parameter(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PageAllocator(**kwargs)  # type: ignore[arg-type]


def test_bad_alloc_and_free_raise_and_change_nothing() -> None:
    a = PageAllocator(8, n_shards=2)
    ids = a.alloc(4)
    assert ids == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="n must be"):
        a.alloc(-1)
    with pytest.raises(ValueError, match="double free"):
        a.free([5])  # never allocated
    with pytest.raises(ValueError, match="outside"):
        a.free([8])  # foreign: not an id of this allocator
    with pytest.raises(ValueError, match="must be an int"):
        a.free([1.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="double free"):
        a.free([1, 2, 1])  # the same id twice in one call
    assert a.num_free == 4  # a rejected free frees nothing, not even its valid ids
    a.free([1])
    with pytest.raises(ValueError, match="double free"):
        a.free([1])
    a.check_integrity()


def test_check_integrity_detects_a_corrupted_free_list() -> None:
    a = PageAllocator(8, n_shards=2)
    a.alloc(2)
    a._free[0].append(0)  # id 0 is in use: listing it as free breaks the accounting
    with pytest.raises(AssertionError):
        a.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    n_shards=st.sampled_from([1, 2, 3]),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 9), st.randoms(use_true_random=False)), max_size=40
    ),
)
def test_random_alloc_free_matches_a_set_model(
    n_shards: int, ops: list[tuple[bool, int, random.Random]]
) -> None:
    capacity = 12 * n_shards
    a = PageAllocator(capacity, n_shards)
    used: set[int] = set()
    for is_alloc, n, rng in ops:
        if is_alloc or not used:
            ids = a.alloc(n)
            if n > capacity - len(used):
                assert ids is None
            else:
                assert ids is not None and len(set(ids)) == n
                assert used.isdisjoint(ids) and all(0 <= i < capacity for i in ids)
                used |= set(ids)
        else:
            chosen = rng.sample(sorted(used), rng.randint(1, len(used)))
            a.free(chosen)
            used -= set(chosen)
        a.check_integrity()
        assert a.num_used == len(used) and a.num_free == capacity - len(used)
        assert all(not a.is_free(i) for i in used)

"""Replay through the real cache manager, checked against independent references."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from kvstrata.bench.reference import BlockLRU, NaiveLRU
from kvstrata.bench.replay import ReplayConfig, Replayer, replay
from kvstrata.bench.synthetic import SyntheticMover
from kvstrata.cache.config import CacheConfig
from kvstrata.storage.memory_store import MemoryStorage
from kvstrata.workloads.generated import MultiTurnConfig, multi_turn
from kvstrata.workloads.trace import Trace, TraceRequest, read_mooncake, write_mooncake

SAMPLE = (
    Path(__file__).resolve().parents[1].parent
    / "shared"
    / "data"
    / "mooncake_synthetic_trace.jsonl"
)
BLOCK = 512


def small_trace(n: int, seed: int = 0, roots: int = 3, max_blocks: int = 6) -> Trace:
    """Hash-id requests over a few prefix trees: shared roots, branches, partial last blocks."""
    rng = random.Random(seed)
    ids: dict[tuple[int, int], int] = {}
    reqs = []
    for i in range(n):
        chain, parent = [], -1 - rng.randrange(roots)
        for _ in range(rng.randint(1, max_blocks)):
            parent = ids.setdefault((parent, rng.randrange(2)), len(ids))
            chain.append(parent)
        length = BLOCK * (len(chain) - 1) + rng.randint(1, BLOCK)
        reqs.append(TraceRequest(i, i * 0.1, length, 4, hash_ids=tuple(chain)))
    return Trace(reqs, source="small")


def block_level_ceiling(requests: list[TraceRequest], page: int) -> int:
    """Independent infinite-capacity hit tokens, computed on hash-id blocks (no page keys).

    A block's identity is its whole hash-id chain; a request can hit full pages of its first
    input_length - 1 tokens; a block a request cached partially holds its full pages only.
    """
    chain_ids: dict[tuple[int, int], int] = {}
    cached: dict[int, int] = {}  # chain id -> tokens of that block cached (multiple of page)
    total = 0
    for r in requests:
        assert r.hash_ids is not None
        hittable = (r.input_length - 1) // page * page
        chain, parent, alive = [], -1, True
        for j, h in enumerate(r.hash_ids):
            parent = chain_ids.setdefault((parent, h), len(chain_ids))
            chain.append(parent)
            if alive:
                have = cached.get(parent, 0)
                room = max(0, hittable - BLOCK * j)
                total += min(have, room)
                alive = have == BLOCK and room > BLOCK
        for j, c in enumerate(chain):
            full = (min(BLOCK, r.input_length - BLOCK * j)) // page * page
            cached[c] = max(cached.get(c, 0), full)
    return total


def test_ceiling_and_tiers_on_a_generated_trace() -> None:
    trace = small_trace(120)
    expect = block_level_ceiling(trace.requests, 64)
    huge = replay(trace, ReplayConfig.sized(10**6))
    assert huge.ceiling_tokens == expect > 0
    assert sum(huge.hit_tokens_by_tier().values()) == expect
    # small device and host pools, unbounded storage: every tier serves hits and together they reach
    # the ceiling
    spill = replay(
        trace,
        ReplayConfig.sized(4096, 8192, "mem://", check_every=1, prefetch_policy="wait_complete"),
    )
    tiers = spill.hit_tokens_by_tier()
    assert all(v > 0 for v in tiers.values()), tiers
    assert sum(tiers.values()) == expect == spill.ceiling_tokens
    rep = spill.report()
    assert (
        rep["bytes_moved"]["storage->host"] == tiers["storage"] // 64 * 64
    )  # 64-byte synthetic pages
    assert rep["storage"]["corrupt_pages"] == 0
    assert rep["evictions"]["device"] > 0 and rep["evictions"]["host"] > 0


@pytest.mark.parametrize("seed,capacity", [(1, 12), (2, 20), (3, 33)])
def test_bounded_lru_matches_naive_reference(seed: int, capacity: int) -> None:
    trace = small_trace(150, seed=seed, roots=4, max_blocks=5)
    cfg = ReplayConfig.sized(capacity * 128, page_size=128, check_every=1)
    r = Replayer(cfg)
    naive = NaiveLRU(capacity)
    for req in trace:
        out, mkeys, ins = r.serve(req)
        hit = naive.match(mkeys)
        fits = len(ins) <= capacity and naive.insert(ins, hit)
        # admission is all or nothing: a request whose pages do not fit is served uncached
        assert out.device == (hit if fits else 0) * 128, f"request {req.rid}"
        cached = {k for n in r.cache.tree.nodes() for k in n.keys}
        assert cached == set(naive.pages), f"request {req.rid}"
    assert r.cache.counters.evictions["device"] > 0  # the capacity really bound


def test_multi_turn_hits_previous_turn_including_output() -> None:
    cfg = MultiTurnConfig(
        clients=3, rounds=3, request_length=400, output_length=130, think_time_s=0.5
    )
    res = replay(multi_turn(cfg), ReplayConfig.sized(10**6))
    by_len = {o.prompt: o.device for o in res.outcomes}
    assert by_len[400] == 0
    assert by_len[930] == 512  # 400 + 130 = 530 tokens cached -> 8 full pages (of 64)
    assert by_len[1460] == 1024  # 930 + 130 = 1060 -> 16 full pages
    assert res.ceiling_tokens == sum(o.hit for o in res.outcomes)


def test_corrupt_storage_pages_are_not_hits() -> None:
    store = MemoryStorage(64)  # the in-process backend behind mem://
    mover = SyntheticMover(store, 64)
    from kvstrata.cache.ops import BACKUP, PREFETCH, TransferOp

    mover.submit(TransferOp(BACKUP, [0, 1, 2], [], keys=[11, 12, 13]))
    store._pages[12] = bytes(64)  # damage the second page
    op = TransferOp(PREFETCH, [], [0, 1, 2], keys=[11, 12, 13])
    mover.submit(op)
    assert mover.poll(op) == 1 and mover.corrupt_pages == 1


def test_file_storage_backend_gives_the_same_hits(tmp_path: Path) -> None:
    trace = small_trace(40, seed=5)
    cfg = ReplayConfig.sized(4096, 4096, "mem://")
    mem = replay(trace, cfg)
    url = f"file://{tmp_path / 'storage'}"
    disk = replay(
        trace, dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, storage_url=url))
    )
    assert [o.hit for o in disk.outcomes] == [o.hit for o in mem.outcomes]
    assert disk.hit_tokens_by_tier()["storage"] > 0


def test_replay_reads_a_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_mooncake(small_trace(30).requests, path)
    rep = replay(read_mooncake(path), ReplayConfig.sized(10**6)).report()
    for key in ("requests", "prompt_tokens", "hit_rate", "hit_rate_by_tier", "ceiling"):
        assert key in rep
    assert rep["requests"] == 30 and rep["hit_rate"] == rep["ceiling"] > 0


def test_bad_replay_config() -> None:
    with pytest.raises(ValueError, match="device_tokens"):
        ReplayConfig.sized(10)
    with pytest.raises(ValueError, match="unknown replay model"):
        Replayer(ReplayConfig(model="nope"))
    with pytest.raises(ValueError, match="unknown eviction policy"):
        Replayer(ReplayConfig(cache=CacheConfig(eviction="mru")))


@pytest.mark.skipif(not SAMPLE.is_file(), reason="sample trace not present")
def test_sample_trace_ceiling_equals_block_level_computation() -> None:
    trace = read_mooncake(SAMPLE, max_requests=700)
    expect = block_level_ceiling(trace.requests, 64)
    res = replay(
        trace,
        ReplayConfig.sized(2_000_000, 4_000_000, "mem://", prefetch_policy="wait_complete"),
    )
    rep = res.report()
    assert res.ceiling_tokens == expect
    assert rep["ceiling"] == expect / trace.prompt_tokens
    tiers = res.hit_tokens_by_tier()
    assert sum(tiers.values()) == expect and tiers["storage"] > 0 and tiers["host"] > 0


def _storage_only_trace() -> Trace:
    """Request A (80 pages), three 80-page fillers that push A out of device and host memory, then A
    again."""
    a = tuple(range(10))  # 10 blocks of 512 tokens = 80 pages of 64
    fillers = [tuple(range(100 * (f + 1), 100 * (f + 1) + 10)) for f in range(3)]
    chains = [a, *fillers, a]
    reqs = [TraceRequest(i, i * 1.0, 10 * BLOCK + 1, 1, hash_ids=c) for i, c in enumerate(chains)]
    return Trace(reqs, source="storage-only")


@pytest.mark.parametrize(
    "policy,storage_pages",
    [
        ("wait_complete", 80),  # waits for every page: 2 ms + 80 x 10 ms = 0.802 s
        ("best_effort", 0),  # the request can run at once, so the prefetch stops at once
        # budget 0.2 s + 80 x 5 ms = 0.6 s; by then (0.6 - 0.002) / 0.01 = 59.8 pages landed
        ("timeout", 59),
    ],
)
def test_prefetch_policy_decides_the_storage_hit(policy: str, storage_pages: int) -> None:
    cfg = ReplayConfig.sized(100 * 64, 100 * 64, "mem://", prefetch_policy=policy, check_every=1)
    res = replay(_storage_only_trace(), cfg)
    last = res.outcomes[-1]
    assert (last.device, last.host, last.storage) == (0, 0, storage_pages * 64)
    assert all(o.hit == 0 for o in res.outcomes[:-1])
    rep = res.report()
    assert rep["prefetch_policy"] == policy
    assert rep["storage"]["corrupt_pages"] == 0
    # the wait is what the policy allowed: all of the read, nothing, or the budget
    bound = {"wait_complete": 0.802, "best_effort": 0.0, "timeout": 0.6}[policy]
    assert bound <= last.storage_wait_s <= bound + 0.02


@pytest.mark.parametrize(
    "clients,rounds,capacity,hit_pages",
    [(4, 6, 40, 190), (5, 8, 64, 398), (6, 5, 60, 245)],
)
def test_round_robin_sessions_hit_as_vllm_block_pool(
    clients: int, rounds: int, capacity: int, hit_pages: int
) -> None:
    """Sessions take turns and their histories together outgrow device memory a little. Evicting
    whole tree nodes threw away a session's entire history to free a few pages (5 x 8 in 64 pages:
    275 hit pages); evicting just the pages needed, from the tail, keeps prefixes the way vLLM's
    block pool does, and the hits equal its reference request by request."""
    trace = multi_turn(
        MultiTurnConfig(
            clients=clients,
            rounds=rounds,
            request_length=256,
            output_length=64,
            request_rate=100.0,
            think_time_s=0.05,
            seed=1,
        )
    )
    r = Replayer(ReplayConfig.sized(capacity * 64, check_every=1))
    pool = BlockLRU(capacity)
    total = 0
    for req in trace:
        out, mkeys, ins = r.serve(req)
        assert out.device == pool.serve(mkeys, ins) * 64, f"request {req.rid}"
        total += out.device // 64
    assert total == hit_pages
    assert r.cache.counters.evictions["device"] > 0

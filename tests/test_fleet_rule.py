"""The fleet's routing rule (kvstrata/router/rule.py), exact cases: a pure function; and the load
it weighs, as read from a replica's /metrics."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvstrata.router.replicas import parse_load
from kvstrata.router.rule import Candidate, choose, rank, session_replica, spread_key
from kvstrata.serve.metrics import ServeMetrics

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def cand(name: str, device: int = 0, host: int = 0, storage: int = 0, load: int = 0) -> Candidate:
    return Candidate(name, device, max(host, device), max(storage, host, device), load)


def test_longest_prefix_wins() -> None:
    cands = [cand(A, device=3), cand(B, device=7), cand(C, device=5)]
    assert rank(cands, 10, None, 0.25) == [B, C, A]


def test_device_beats_host_beats_storage() -> None:
    # the same 8 pages: on device at A, in host memory at B, only in storage at C
    cands = [cand(C, storage=8), cand(B, host=8), cand(A, device=8)]
    assert rank(cands, 8, "s", 0.25) == [A, B, C]
    # but more pages in host memory beat fewer on device: 0.8 * 8 > 1.0 * 5
    assert choose([cand(A, device=5), cand(B, host=8)], 8, None, 0.25) == B


def test_shared_store_counts_for_all() -> None:
    # every replica reads the same store: equal matches, so the load decides
    cands = [cand(A, storage=6, load=2), cand(B, storage=6, load=0), cand(C, storage=6, load=1)]
    assert rank(cands, 6, "s", 0.25) == [B, C, A]


def test_load_term_moves_a_hot_prefix() -> None:
    hot = [cand(A, device=8, load=3), cand(B, load=0)]
    assert choose(hot, 8, "s", 0.25) == A  # 0 + 0.75 < 1 + 0
    hotter = [cand(A, device=8, load=5), cand(B, load=0)]
    assert choose(hotter, 8, "s", 0.25) == B  # 0 + 1.25 > 1 + 0
    assert choose(hotter, 8, "s", 0.0) == A  # no load term: the prefix always wins


def test_no_prefix_goes_to_the_sessions_replica() -> None:
    names = [A, B, C]
    for s in (f"session-{i}" for i in range(20)):
        home = session_replica(s, names)
        loads = {A: 5, B: 0, C: 9}  # the load does not move a session off its replica
        assert choose([cand(n, load=loads[n]) for n in names], 4, s, 0.25) == home
    # no session: the least loaded
    assert choose([cand(A, load=2), cand(B, load=1), cand(C, load=3)], 4, None, 0.25) == B


def test_consistent_hashing_moves_only_the_leavers_sessions() -> None:
    sessions = [f"user-{i}" for i in range(300)]
    before = {s: session_replica(s, [A, B, C]) for s in sessions}
    after = {s: session_replica(s, [A, C]) for s in sessions}
    moved = {s for s in sessions if before[s] != after[s]}
    assert moved == {s for s in sessions if before[s] == B}
    assert 60 < len(moved) < 140  # B had about a third of them


def test_load_is_read_from_a_replicas_metrics() -> None:
    m = ServeMetrics("tiny")
    m.running.labels(model_name="tiny").set(2)
    m.waiting.labels(model_name="tiny").set(3)
    assert parse_load(generate_latest(m.registry).decode()) == 5


def test_anonymous_prompts_spread_by_their_first_page_on_an_idle_fleet() -> None:
    names = [A, B, C]
    idle = [cand(n) for n in names]
    firsts = [spread_key([i, i + 1]) for i in range(60)]
    picked = [choose(idle, 4, None, 0.25, f) for f in firsts]
    assert set(picked) == set(names)  # not one replica for every anonymous prompt
    for f, p in zip(firsts, picked, strict=True):  # the same first page meets the same replica
        assert choose(idle, 4, None, 0.25, f) == p
        assert p == session_replica(f, names)

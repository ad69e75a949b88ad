"""Mooncake backend against a real mooncake_master: the backend contract, corruption, zero-copy,
units visible only once committed, a master crash, a hung master, a master not up yet, a
client whose segment left, and a forked child refused (the wheel's client does not survive fork)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import os
import signal
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kvstrata.bench.local_mooncake import MooncakeMaster
from kvstrata.cache.keys import key_hex
from kvstrata.local_ports import refused_port
from kvstrata.memory.layout import KVShape
from kvstrata.storage.base import encode_header, open_storage
from kvstrata.storage.mooncake_client import used_in_this_process
from kvstrata.storage.mooncake_store import MooncakeStore
from kvstrata.storage.sealed import SealedStore
from kvstrata.storage.sealer import SEAL_OVERHEAD, Sealer
from kvstrata.storage.units import PagePart, UnitLayout, open_unit_storage

try:
    from tests.mooncake_server import FAST, fast, master
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from mooncake_server import FAST, fast, master  # type: ignore[no-redef]

PAGE = 4096
_MASK64 = (1 << 64) - 1


def make_keys(n: int, salt: int = 0) -> list[int]:
    return [((i + 1) * 0x9E3779B97F4A7C15_F39CC0605CEDC834 + salt) % (1 << 128) for i in range(n)]


def page_for(key: int) -> np.ndarray:
    return np.random.default_rng(key & _MASK64).integers(0, 256, PAGE, dtype=np.uint8)


@pytest.fixture(scope="module")
def shared_master() -> Iterator[MooncakeMaster]:
    m = master()
    yield m
    m.stop()


@pytest.fixture
def own_master() -> Iterator[MooncakeMaster]:
    """A master this test alone may kill, stop and restart."""
    m = master()
    yield m
    m.stop()


@pytest.fixture
def store(shared_master: MooncakeMaster, request: pytest.FixtureRequest) -> Iterator[MooncakeStore]:
    cfg = fast(mooncake_batch_pages=4)
    s = open_storage(shared_master.url(prefix=f"t-{request.node.name}:"), PAGE, cfg)
    assert isinstance(s, MooncakeStore)
    yield s
    s.check_integrity()
    s.close()


def _wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_round_trip_is_exact_across_batches(store: MooncakeStore) -> None:
    keys = make_keys(10)  # 10 pages in batches of 4: three transfers each way
    pages = [page_for(k) for k in keys]
    assert store.put(keys, pages) == 10
    assert store.exists_prefix(keys) == 10
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 10
    for o, p in zip(out, pages, strict=True):
        np.testing.assert_array_equal(o, p)
    st = store.stats()
    assert st["puts"] == 10 and st["get_hits"] == 10 and st["staged_pages"] == 20
    assert st["corrupt"] == 0 and st["connection_errors"] == 0


def test_prefix_counts_stop_at_first_miss(store: MooncakeStore) -> None:
    keys = make_keys(9, salt=1)
    present = [0, 1, 2, 3, 4, 6, 7]  # key 5 missing, in the second batch of 4
    assert store.put([keys[i] for i in present], [page_for(keys[i]) for i in present]) == 7
    assert store.exists_prefix(keys) == 5
    assert store.exists_prefix(keys[6:]) == 2
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 5
    assert not out[6].any(), "get copied past the first miss"


def test_corrupt_or_foreign_values_are_misses_and_removed(store: MooncakeStore) -> None:
    keys = make_keys(4, salt=2)
    good = [0, 3]
    assert store.put([keys[i] for i in good], [page_for(keys[i]) for i in good]) == 2
    raw = store.client.store  # the wheel's own client: plain puts of bad values
    prefix = store.target.prefix
    flipped = bytearray(encode_header(keys[1], page_for(keys[1])) + page_for(keys[1]).tobytes())
    flipped[-100] ^= 0x10  # one flipped payload bit
    assert raw.put(f"{prefix}{key_hex(keys[1])}", bytes(flipped)) == 0
    foreign = encode_header(keys[3], page_for(keys[3])) + page_for(keys[3]).tobytes()
    assert raw.put(f"{prefix}{key_hex(keys[2])}", foreign) == 0  # a valid page of another key
    assert store.exists_prefix(keys) == 4  # existence alone cannot see it
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 1 and store.stats()["corrupt"] == 1
    assert store.exists_prefix(keys) == 1, "the corrupt value was not removed"
    assert store.put(keys[1:2], [page_for(keys[1])]) == 1
    assert store.get(keys, out) == 2 and store.stats()["corrupt"] == 2
    np.testing.assert_array_equal(out[1], page_for(keys[1]))
    assert raw.put(f"{prefix}{key_hex(keys[2])}", b"short") == 0
    assert store.get(keys, out) == 2


def test_zero_copy_path_equals_staged_path(store: MooncakeStore) -> None:
    keys = make_keys(6, salt=3)
    pool = np.zeros((12, PAGE), np.uint8)  # a host pool: registered once
    assert store.register_buffer(pool)
    pool[:6] = np.stack([page_for(k) for k in keys])
    assert store.put(keys[:3], list(pool[:3])) == 3  # zero-copy put
    assert store.put(keys[3:], [p.copy() for p in pool[3:6]]) == 3  # staged put
    assert store.stats()["zero_copy_pages"] == 3 and store.stats()["staged_pages"] == 3
    assert store.get(keys, list(pool[6:12])) == 6  # zero-copy get of both kinds
    np.testing.assert_array_equal(pool[6:12], pool[:6])
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 6  # staged get of both kinds
    np.testing.assert_array_equal(np.stack(out), pool[:6])
    raw = store.client.store
    values = [raw.get(f"{store.target.prefix}{key_hex(k)}") for k in keys]
    assert all(
        v == encode_header(k, page_for(k)) + page_for(k).tobytes()
        for k, v in zip(keys, values, strict=True)
    )


def test_key_prefixes_isolate_stores(shared_master: MooncakeMaster) -> None:
    a = open_storage(shared_master.url(prefix="iso-a:"), PAGE, FAST)
    b = open_storage(shared_master.url(prefix="iso-b:"), PAGE, FAST)
    keys = make_keys(2, salt=4)
    assert a.put(keys, [page_for(k) for k in keys]) == 2
    assert b.exists_prefix(keys) == 0 and a.exists_prefix(keys) == 2
    assert isinstance(a, MooncakeStore) and a.client is b.client  # one client, one segment
    a.close()
    b.close()


def test_bad_input_and_bad_urls_are_value_errors(store: MooncakeStore) -> None:
    with pytest.raises(ValueError, match="4096 bytes"):
        store.put(make_keys(1), [np.zeros(PAGE - 1, np.uint8)])
    for url, msg in (
        ("mooncake://127.0.0.1", "HOST:RPC_PORT"),
        ("mooncake://127.0.0.1:1?segment=lots", "segment='lots'"),
        ("mooncake://127.0.0.1:1?protocol=udp", "protocol"),
        ("mooncake://127.0.0.1:1?colour=red", "unknown option"),
    ):
        with pytest.raises(ValueError, match=msg):
            open_storage(url, PAGE, FAST)


def test_unreachable_master_at_start_is_a_bounded_value_error() -> None:
    cfg = fast(mooncake_setup_timeout_s=3.0)
    # held bound, never listening: no master another test starts meanwhile can take them
    with refused_port() as port, refused_port() as meta:
        url = f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{meta}/metadata"
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}.*unreachable"):
            open_storage(url, PAGE, cfg)
    assert time.monotonic() - t0 < 30.0


@pytest.mark.slow
def test_master_crash_gives_misses_and_restart_reconnects(
    own_master: MooncakeMaster, capfd: pytest.CaptureFixture[str]
) -> None:
    store = open_storage(own_master.url(), PAGE, FAST)
    keys = make_keys(6, salt=5)
    pages = [page_for(k) for k in keys]
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.put(keys, pages) == 6 and store.get(keys, out) == 6
    own_master.kill()
    for _ in range(5):  # no exception reaches the caller; every call is a miss or a skip
        assert store.get(keys, out) == 0
        assert store.exists_prefix(keys) == 0
        assert store.put(keys, pages) == 0
        assert store.delete(keys) == 0
        time.sleep(0.03)
    st = store.stats()
    assert st["connection_errors"] >= 1 and st["put_skipped"] == 30 and st["get_misses"] == 5
    ours = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("kvstrata:")]
    assert len(ours) == 1 and "mooncake master" in ours[0], ours
    store.check_integrity()
    own_master.start()  # same ports, empty: the pages are gone (never assumed durable)
    assert _wait_until(lambda: store.put(keys, pages) == 6), store.stats()
    assert store.get(keys, out) == 6
    np.testing.assert_array_equal(np.stack(out), np.stack(pages))
    assert store.stats()["reconnects"] >= 1 and store.stats()["down"] == 0
    store.check_integrity()
    store.close()


def _hung_master_calls(url: str, master_pid: int, q: multiprocessing.queues.Queue) -> None:
    """Put, stop the master (SIGSTOP: alive but silent), get and put again, let it go on; puts
    what each call returned and the counters on `q` (or the error)."""
    try:
        store = open_storage(url, PAGE, FAST)
        keys = make_keys(2, salt=6)
        pages = [page_for(k) for k in keys]
        report: dict[str, object] = {"put": store.put(keys, pages)}
        os.kill(master_pid, signal.SIGSTOP)
        try:
            report["get"] = store.get(keys, [np.zeros(PAGE, np.uint8) for _ in keys])
            report["put_again"] = store.put(keys, pages)
            report["stats"] = store.stats()
        finally:
            os.kill(master_pid, signal.SIGCONT)
        report["back"] = _wait_until(lambda: store.exists_prefix(keys) == 2)
        store.check_integrity()
        store.close()
        q.put(report)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put({"error": repr(e)})


@pytest.mark.slow
def test_hung_master_times_out_into_misses(own_master: MooncakeMaster) -> None:
    """In a spawned process, as a serving process's first client: in a pytest worker where
    earlier tests' clients had run, the wheel's client once answered the get with the master
    stopped (its only listener), in three full runs out of three; not explained."""
    assert own_master.proc is not None
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_hung_master_calls, args=(own_master.url(), own_master.proc.pid, q))
    child.start()
    try:
        report = q.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
        own_master.proc.send_signal(signal.SIGCONT)  # whatever happened to the child
    assert "error" not in report, report
    # the get waited out its bound once: a miss; the put did not wait at all (skipped within
    # the backoff, not a second timeout): counted, where a wall-clock bound could be missed
    assert (report["put"], report["get"], report["put_again"]) == (2, 0, 0), report
    st = report["stats"]
    assert st["timeouts"] == 1 and st["calls_skipped_down"] == 1, st
    assert report["back"], report


@pytest.mark.slow
def test_pages_in_a_segment_that_left_are_misses(own_master: MooncakeMaster) -> None:
    holder = open_storage(own_master.url(segment="16m", prefix="seg:"), PAGE, FAST)
    reader = open_storage(own_master.url(segment="0", prefix="seg:"), PAGE, FAST)
    assert isinstance(holder, MooncakeStore) and isinstance(reader, MooncakeStore)
    assert holder.client is not reader.client  # two clients; only the holder has memory
    keys = make_keys(5, salt=7)
    pages = [page_for(k) for k in keys]
    assert reader.put(keys, pages) == 5  # placed in the holder's segment
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert reader.get(keys, out) == 5
    holder.close()  # its client leaves and takes its segment (and the pages) with it
    assert _wait_until(lambda: reader.get(keys, out) == 0 and reader.exists_prefix(keys) == 0)
    assert reader.put(keys, pages) == 0  # nowhere to place them: a counted skip, no error
    st = reader.stats()
    assert st["server_errors"] >= 5 and st["put_skipped"] >= 5
    reader.check_integrity()
    reader.close()


@pytest.mark.slow
def test_unreachable_allowed_at_start_gives_misses_then_joins() -> None:
    m = MooncakeMaster()  # ports chosen, not started yet
    try:
        cfg = fast(require_reachable_at_start=False)
        store = open_storage(m.url(prefix="late:"), PAGE, cfg)
        keys = make_keys(3, salt=8)
        pages = [page_for(k) for k in keys]
        assert store.put(keys, pages) == 0 and store.exists_prefix(keys) == 0
        assert store.stats()["connection_errors"] >= 1
        m.start()
        assert _wait_until(lambda: store.put(keys, pages) == 3), store.stats()
        assert store.exists_prefix(keys) == 3 and store.stats()["setups"] >= 2
        store.check_integrity()
        store.close()
    finally:
        m.stop()


def test_a_page_is_visible_only_once_all_its_units_and_its_commit_are_in(
    shared_master: MooncakeMaster,
) -> None:
    """Two half-head writers (as two tp ranks) and a whole-page reader over units in Mooncake."""
    full = KVShape(2, 2, 16, 8)
    url = shared_master.url(prefix="units:")
    halves = [PagePart(full, (0, 2), (h, h + 1)) for h in (0, 1)]
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 255, full.page_nbytes, dtype=np.uint8) for _ in range(3)]
    keys = [11, 12, 13]
    whole = PagePart(full, (0, 2), (0, 2))
    writers = [open_unit_storage(url, part, FAST, commit_on_put=False) for part in halves]
    for h, (w, part) in enumerate(zip(writers, halves, strict=True)):
        cut = [part.view(p, full=True)[:, :, :, h : h + 1].contiguous() for p in pages]
        assert w.put(keys, [c.view(-1).view(torch.uint8).numpy() for c in cut]) == 3
        assert w.exists_prefix(keys) == 0  # units in, no commit yet
    assert writers[1].commit(keys[:2]) == 2  # the third page's commit never came
    r = open_unit_storage(url, whole, FAST)
    assert r.exists_prefix(keys) == 2
    out = [np.zeros(full.page_nbytes, np.uint8) for _ in keys]
    assert r.get(keys, out) == 3  # units are all there; visibility is the probe's answer
    assert all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True))
    for s in (*writers, r):  # one shared client: its segment (and the units) live until the last
        s.check_integrity()
        s.close()


def _open_in_child(url: str, q: multiprocessing.queues.Queue) -> None:
    try:
        open_storage(url, PAGE, FAST)
        q.put("opened")
    except ValueError as e:
        q.put(str(e))


def test_a_process_forked_after_a_client_was_used_is_refused_not_hung(
    store: MooncakeStore, shared_master: MooncakeMaster
) -> None:
    assert used_in_this_process()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_open_in_child, args=(shared_master.url(prefix="fork:"), q))
    child.start()
    try:
        assert "forked from one that used a Mooncake client" in q.get(timeout=30)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()


def test_a_whole_page_unit_moves_zero_copy_from_a_registered_host_pool(
    shared_master: MooncakeMaster,
) -> None:
    """A unit layout of one unit per page: puts from and gets into registered host memory
    (as the engine's host pool is registered) move no byte through the staging area."""
    full = KVShape(2, 2, 16, 8)
    whole = PagePart(full, (0, 2), (0, 2))
    store = open_unit_storage(
        shared_master.url(prefix="zc:"), whole, FAST, layout=UnitLayout(full, 2, 2)
    )
    host = np.random.default_rng(1).integers(0, 255, (6, full.page_nbytes), dtype=np.uint8)
    assert store.register_buffer(host)
    assert store.put([1, 2, 3], list(host[:3])) == 3
    assert store.get([1, 2, 3], list(host[3:])) == 3
    np.testing.assert_array_equal(host[3:], host[:3])
    st = store.stats()
    assert st["zero_copy_pages"] == 6 and st["staged_pages"] == 0, st
    store.close()


@pytest.mark.slow
def test_a_full_store_skips_puts_and_evicted_pages_are_misses(own_master: MooncakeMaster) -> None:
    """40 MiB into a 16 MiB segment: what does not fit is a counted skip, what Mooncake evicts
    is a miss, and every page that is read has exactly its bytes (nothing assumes durability)."""
    big = 1 << 20
    store = open_storage(own_master.url(segment="16m", buffer="16m", prefix="full:"), big, FAST)
    pages = [np.full(big, i, np.uint8) for i in range(40)]
    stored = [store.put([i + 1], [pages[i]]) for i in range(40)]
    st = store.stats()
    assert st["puts"] == sum(stored) < 40 and st["put_skipped"] == 40 - sum(stored)
    assert st["server_errors"] == 40 - sum(stored) and st["connection_errors"] == 0
    out, readable = np.zeros(big, np.uint8), 0
    for i in range(40):
        if store.get([i + 1], [out]) == 1:
            readable += 1
            assert (out == i).all(), i
    assert 0 < readable <= sum(stored) and store.stats()["corrupt"] == 0
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "encrypted"])
def test_sealed_units_move_in_place_and_tampering_is_a_counted_miss(
    shared_master: MooncakeMaster, encrypt: bool
) -> None:
    """Sealed units over Mooncake: a MAC'd body moves in place from and into a registered host
    pool, and the tag replaces the xxh3 pass. A put stages the 44-byte tail (encrypted: the
    ciphertext, sealed into a reused scratch); a get moves every byte in place (MAC: the tail
    into its own registered place; encrypted: the value into a registered landing ring). A
    value re-headed by a writer without the key is a counted miss that stays, a flipped byte is
    removed."""
    cfg = fast(mooncake_batch_pages=4)
    inner = open_storage(shared_master.url(prefix=f"seal-{encrypt}:"), PAGE + SEAL_OVERHEAD, cfg)
    assert isinstance(inner, MooncakeStore)
    store = SealedStore(inner, Sealer(bytes(range(32)), encrypt))
    keys = make_keys(6, salt=11)
    pool = np.zeros((12, PAGE), np.uint8)
    assert store.register_buffer(pool)
    pool[:6] = np.stack([page_for(k) for k in keys])
    assert store.put(keys, list(pool[:6])) == 6  # two batches of 4 and 2
    assert store.get(keys, list(pool[6:])) == 6
    np.testing.assert_array_equal(pool[6:], pool[:6])
    st = store.stats()
    per_unit = PAGE + SEAL_OVERHEAD if encrypt else SEAL_OVERHEAD  # ciphertext goes via scratch
    assert st["staged_bytes"] == 6 * per_unit and st["staged_pages"] == 6, st  # the puts
    assert st["zero_copy_pages"] == 6, st  # the get
    assert st["opened"] == 6 and st["seal_failures"] == 0 and st["corrupt"] == 0
    raw, prefix = inner.client.store, inner.target.prefix
    forged = np.concatenate([page_for(keys[1]), np.zeros(SEAL_OVERHEAD, np.uint8)])  # no tag
    assert inner.delete(keys[1:2]) == 1
    value = encode_header(keys[1], forged) + forged.tobytes()  # a valid header
    assert raw.put(f"{prefix}{key_hex(keys[1])}", value) == 0
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 1 and store.stats()["seal_failures"] == 1
    assert inner.exists_prefix(keys) == 6, "a value intact under its checksum was removed"
    flipped = bytearray(raw.get(f"{prefix}{key_hex(keys[2])}"))
    flipped[-100] ^= 0x10  # one stored bit, header unchanged
    assert inner.delete(keys[2:3]) == 1
    assert raw.put(f"{prefix}{key_hex(keys[2])}", bytes(flipped)) == 0
    assert store.get(keys[2:], out[2:]) == 0
    st = store.stats()
    assert st["seal_failures"] == 2 and st["corrupt"] == 1
    assert inner.exists_prefix(keys[2:3]) == 0, "the corrupt value was not removed"
    assert store.get(keys[3:], out[3:]) == 3
    np.testing.assert_array_equal(np.stack(out[3:]), pool[3:6])
    assert store.put(keys[1:3], list(pool[1:3])) == 2  # the next backup replaces both
    assert store.stats()["rewrites"] == 2
    assert store.get(keys, out) == 6
    np.testing.assert_array_equal(np.stack(out), pool[:6])
    store.check_integrity()
    store.close()


def test_a_get_reads_ahead_only_where_no_unchecked_byte_is_overwritten(
    store: MooncakeStore,
) -> None:
    """A get reads batch b + 1 while batch b is checked: a buffer given again in the same or the
    next batch (batches of 4) is staged there, one given two batches later moves in place, and
    every value checks out with its own bytes either way."""
    keys = make_keys(12, salt=21)
    assert store.put(keys, [page_for(k) for k in keys]) == 12
    assert store.reuse_after == 8
    ring = np.zeros((8, PAGE), np.uint8)  # value i lands in ring[i % 8]: 0 and 8 share a place
    assert store.register_buffer(ring)
    seen: list[int] = []

    def landed_in(places: int) -> Callable[[int], bool]:
        def verify(i: int) -> bool:  # value i's own bytes, not a later value's
            seen.append(i)
            return bool(np.array_equal(ring[i % places], page_for(keys[i])))

        return verify

    before = store.stats()
    pieces = [[memoryview(ring[i % 8])] for i in range(12)]
    assert store.get_verified(keys, pieces, landed_in(8)) == 12 and seen == list(range(12))
    st = store.stats()
    assert st["zero_copy_pages"] - before["zero_copy_pages"] == 12, st
    assert st["staged_pages"] == before["staged_pages"], st
    close = [[memoryview(ring[i % 4])] for i in range(12)]  # given again in the next batch
    seen.clear()
    assert store.get_verified(keys, close, landed_in(4)) == 12 and seen == list(range(12))
    assert store.stats()["staged_pages"] - st["staged_pages"] == 8  # all but the first uses


def test_a_failed_check_ends_the_get_after_the_batch_read_ahead_lands(
    store: MooncakeStore,
) -> None:
    """A value failing its check in batch 1 ends the get there: the batch read ahead (batch 2)
    is waited out before the get returns (its bytes land in the caller's pages), later values
    are never checked, and the next get of the same store works."""
    keys = make_keys(12, salt=22)
    assert store.put(keys, [page_for(k) for k in keys]) == 12
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    checked: list[int] = []

    def verify(i: int) -> bool:
        checked.append(i)
        return i != 5

    pieces = [[memoryview(o)] for o in out]
    assert store.get_verified(keys, pieces, verify) == 5
    assert checked == [0, 1, 2, 3, 4, 5]
    assert store.exists_prefix(keys) == 12, "a value intact under its checksum was removed"
    assert store.get(keys, out) == 12
    np.testing.assert_array_equal(np.stack(out), np.stack([page_for(k) for k in keys]))

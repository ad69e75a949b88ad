"""File backend: exact round trips, prefix semantics, corruption, LRU size cap, many processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvstrata.cache.keys import key_hex
from kvstrata.storage.base import HEADER_NBYTES, open_storage
from kvstrata.storage.config import storage_config
from kvstrata.storage.file_io import READ_CHUNK
from kvstrata.storage.file_store import FileStore

PAGE = 4096
_MASK64 = (1 << 64) - 1


def make_keys(n: int, salt: int = 0) -> list[int]:
    """Keys spread over the whole 128-bit range (so several fan-out directories are used)."""
    return [((i + 1) * 0x9E3779B97F4A7C15_F39CC0605CEDC834 + salt) % (1 << 128) for i in range(n)]


def page_for(key: int, nbytes: int = PAGE) -> np.ndarray:
    """The one correct page for `key` (deterministic, so any process can check a read)."""
    return np.random.default_rng(key & _MASK64).integers(0, 256, nbytes, dtype=np.uint8)


def page_file(store: FileStore, key: int) -> Path:
    h = key_hex(key)
    return store.root / h[:2] / f"{h}.kvp"


def du(root: Path) -> int:
    """What the store's page files and fan-out directories take on disk (as `du` counts)."""
    subs = [d for d in root.iterdir() if len(d.name) == 2 and d.is_dir()]
    files = [f for d in subs for f in d.glob("*.kvp")]
    return sum(p.stat().st_blocks * 512 for p in [*subs, *files])


def per_page(store: FileStore) -> int:
    """Disk bytes of one page in its own fan-out directory (make_keys spreads the keys)."""
    return store.file_disk_nbytes + store.dir_disk_nbytes


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    s = open_storage(str(tmp_path / "storage"), PAGE)
    assert isinstance(s, FileStore)
    return s


def test_round_trip_is_exact(store: FileStore) -> None:
    keys = make_keys(20)
    pages = [page_for(k) for k in keys]
    pages[0][:] = 0
    pages[1][:] = 255
    assert store.put(keys, pages) == 20
    out = [np.full(PAGE, 7, np.uint8) for _ in keys]
    assert store.get(keys, out) == 20
    for o, p in zip(out, pages, strict=True):
        np.testing.assert_array_equal(o, p)
    assert page_file(store, keys[3]).stat().st_size == PAGE + HEADER_NBYTES
    st = store.stats()
    assert (
        st["puts"] == 20
        and st["get_hits"] == 20
        and st["bytes_estimate"] == du(store.root) == 20 * per_page(store)
    )
    store.check_integrity()


def test_pages_of_other_shapes_and_reopen(tmp_path: Path) -> None:
    """Any C-contiguous array of page_nbytes is a page; a new instance sees stored pages."""
    a = open_storage(str(tmp_path / "d"), PAGE)
    keys = make_keys(2)
    f32 = np.linspace(-1, 1, PAGE // 4, dtype=np.float32).reshape(4, -1)  # [4, 256] float32
    assert a.put(keys[:1], [f32]) == 1
    b = open_storage(f"file://{tmp_path / 'd'}", PAGE)
    out = np.zeros_like(f32)
    assert b.exists_prefix(keys) == 1 and b.get(keys[:1], [out]) == 1
    np.testing.assert_array_equal(out, f32)


def test_exists_prefix_and_get_count_only_leading_hits(store: FileStore) -> None:
    keys = make_keys(6)
    present = [0, 1, 3, 4]  # key 2 missing: the prefix is 2 although 4 pages are stored
    assert store.put([keys[i] for i in present], [page_for(keys[i]) for i in present]) == 4
    assert store.exists_prefix(keys) == 2
    assert store.exists_prefix(keys[3:]) == 2
    assert store.exists_prefix(keys[2:]) == 0
    assert store.exists_prefix([]) == 0
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 2
    assert not out[3].any(), "get read past the first miss"
    assert store.stats()["get_misses"] == 1


def test_delete(store: FileStore) -> None:
    keys = make_keys(3)
    store.put(keys, [page_for(k) for k in keys])
    assert store.delete([keys[1], keys[1], make_keys(1, salt=99)[0]]) == 1
    assert store.exists_prefix(keys) == 1 and not page_file(store, keys[1]).exists()


def _flip_payload(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[HEADER_NBYTES + 100] ^= 0x01
    p.write_bytes(bytes(data))


def _flip_header_key(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[HEADER_NBYTES - 1] ^= 0x80
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    os.truncate(p, PAGE // 2)


def _empty(p: Path) -> None:
    os.truncate(p, 0)


@pytest.mark.parametrize("damage", [_flip_payload, _flip_header_key, _truncate, _empty])
def test_damaged_page_is_a_miss_and_is_removed(store: FileStore, damage: object) -> None:
    keys = make_keys(3)
    store.put(keys, [page_for(k) for k in keys])
    victim = page_file(store, keys[1])
    damage(victim)  # type: ignore[operator]
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert store.get(keys, out) == 1
    assert not victim.exists(), "a damaged page file must be removed"
    assert store.stats()["corrupt"] == 1
    np.testing.assert_array_equal(out[0], page_for(keys[0]))
    store.check_integrity()
    assert store.put(keys[1:2], [page_for(keys[1])]) == 1  # rewritten, it reads back fine
    assert store.get(keys, out) == 3


@pytest.mark.parametrize("damage", ["none", "flip_last_piece", "cut_in_second_piece"])
def test_pages_read_in_pieces_are_verified_whole(tmp_path: Path, damage: str) -> None:
    """A page larger than READ_CHUNK is read and hashed piece by piece (the last piece partial):
    its bytes are exact, and damage past the first piece is still a miss."""
    nbytes = 2 * READ_CHUNK + 1000
    store = FileStore(str(tmp_path / "storage"), nbytes)
    keys = make_keys(2)
    assert store.put(keys, [page_for(k, nbytes) for k in keys]) == 2
    victim = page_file(store, keys[1])
    if damage == "flip_last_piece":
        with open(victim, "r+b") as f:
            f.seek(HEADER_NBYTES + 2 * READ_CHUNK + 999)
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([last ^ 0x10]))
    elif damage == "cut_in_second_piece":
        os.truncate(victim, HEADER_NBYTES + READ_CHUNK + 10)
    out = [np.zeros(nbytes, np.uint8) for _ in keys]
    hits = store.get(keys, out)
    np.testing.assert_array_equal(out[0], page_for(keys[0], nbytes))
    if damage == "none":
        assert hits == 2
        np.testing.assert_array_equal(out[1], page_for(keys[1], nbytes))
    else:
        assert hits == 1 and store.stats()["corrupt"] == 1 and not victim.exists()
    store.check_integrity()


def test_bad_input_is_a_value_error(store: FileStore) -> None:
    keys = make_keys(2)
    with pytest.raises(ValueError, match="4096 bytes"):
        store.put(keys[:1], [np.zeros(PAGE + 1, np.uint8)])
    with pytest.raises(ValueError, match="4096 bytes"):
        store.put(keys[:1], [np.zeros(2 * PAGE, np.uint8)[::2]])  # right size, not contiguous
    with pytest.raises(ValueError, match="2 keys but 1 pages"):
        store.put(keys, [page_for(keys[0])])
    with pytest.raises(ValueError, match="get out"):
        store.get(keys[:1], [np.zeros(PAGE - 1, np.uint8)])
    with pytest.raises(ValueError, match="128-bit"):
        store.put([-1], [page_for(1)])
    assert store.exists_prefix(keys) == 0


def test_directory_creation_rules(tmp_path: Path) -> None:
    assert open_storage(str(tmp_path / "new"), PAGE).root.is_dir()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="parent directory"):
        open_storage(str(tmp_path / "no" / "such"), PAGE)
    with pytest.raises(ValueError, match="create_dir"):
        open_storage(str(tmp_path / "off"), PAGE, storage_config(create_dir=False))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        open_storage(str(tmp_path / "afile"), PAGE)


def test_size_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    fnb = per_page(FileStore(str(tmp_path / "cap"), PAGE))  # a page file and its directory
    cfg = storage_config(max_bytes=3 * fnb, evict_to_fraction=1.0)
    store = open_storage(str(tmp_path / "cap"), PAGE, cfg)
    a, b, c, d, e = make_keys(5)
    for k in (a, b, c):
        assert store.put([k], [page_for(k)]) == 1
    assert store.get([a], [np.zeros(PAGE, np.uint8)]) == 1  # a is now the most recently used
    assert store.put([d], [page_for(d)]) == 1  # over the cap: b (oldest) goes
    assert [store.exists_prefix([k]) for k in (a, b, c, d)] == [1, 0, 1, 1]
    assert (
        store.exists_prefix([c]) == 1 and store.put([c], [page_for(c)]) == 1
    )  # re-put refreshes c
    assert store.put([e], [page_for(e)]) == 1  # now a is the oldest
    assert [store.exists_prefix([k]) for k in (a, c, d, e)] == [0, 1, 1, 1]
    assert store.stats()["evicted"] == 2 and store.stats()["bytes_estimate"] == 3 * fnb
    assert du(tmp_path / "cap") == 3 * fnb  # the evicted pages' directories went too
    # a second instance (another process, say) starts from the real size on disk
    other = open_storage(str(tmp_path / "cap"), PAGE, cfg)
    assert other.stats()["bytes_estimate"] == 3 * fnb
    other.check_integrity()


def test_size_cap_low_watermark_and_stale_temp_files(tmp_path: Path) -> None:
    fnb = per_page(FileStore(str(tmp_path / "probe"), PAGE))
    root = tmp_path / "wm"
    (root / "ab").mkdir(parents=True)
    stale = root / "ab" / ".dead.kvp.1.2.3.tmp"  # left by a crashed writer
    stale.write_bytes(b"x" * 10)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    store = open_storage(str(root), PAGE, storage_config(max_bytes=10 * fnb, evict_to_fraction=0.5))
    assert not stale.exists()
    keys = make_keys(11)
    for k in keys:
        store.put([k], [page_for(k)])
    # the emptied ab/ directory (a block on disk) made the 10th put cross the cap: the clean-up
    # removed it and went down to the low watermark (5 pages) at once; then the 11th page came
    assert store.stats()["bytes_estimate"] == du(root) == 6 * fnb
    assert store.exists_prefix(keys[-1:]) == 1 and store.exists_prefix(keys[:1]) == 0
    store.check_integrity()


# ---- several real processes sharing one directory -----------------------------------------
N_SHARED = 24
BIG = 64 * 1024


def _writer(root: str, seed: int, rounds: int) -> None:
    """Replace every page over and over (delete + put) so readers race with renames."""
    store = open_storage(
        root, BIG, storage_config(max_bytes=(N_SHARED // 2) * (BIG + HEADER_NBYTES))
    )
    keys = make_keys(N_SHARED)
    rng = np.random.default_rng(seed)
    pages = {k: page_for(k, BIG) for k in keys}
    for _ in range(rounds):
        order = rng.permutation(N_SHARED)
        for lo in range(0, N_SHARED, 4):
            chunk = [keys[i] for i in order[lo : lo + 4]]
            store.delete(chunk[:2])
            store.put(chunk, [pages[k] for k in chunk])


def test_concurrent_writers_and_reader_see_whole_pages_or_misses(tmp_path: Path) -> None:
    root = str(tmp_path / "shared")
    reader = open_storage(root, BIG)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(root, s, 12)) for s in (1, 2)]
    for p in procs:
        p.start()
    keys = make_keys(N_SHARED)
    want = {k: page_for(k, BIG) for k in keys}
    out = np.empty(BIG, np.uint8)
    hits = misses = 0
    deadline = time.monotonic() + 120
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        for k in keys:
            out[:] = 0
            if reader.get([k], [out]) == 1:
                hits += 1
                assert np.array_equal(out, want[k]), "a read returned a torn or wrong page"
            else:
                misses += 1
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0, f"writer exited with {p.exitcode}"
    assert hits > 0, "the reader never saw a page: the race was not exercised"
    # atomic replace: a reader never even sees a torn file (the checksum would turn it into a miss)
    assert reader.stats()["corrupt"] == 0, reader.stats()
    reader.check_integrity()  # every page file left is whole and correctly named
    leftovers = [p for p in Path(root).rglob("*.tmp")]
    assert not leftovers, leftovers

"""Sealed storage units (a cluster key): round trips, every tampering a miss that is counted, a
store rewritten with valid headers gives the cold run's output, owner-only files; `kvstrata
keys`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
import zmq.auth

from kvstrata.cli.main import main
from kvstrata.memory.layout import KVShape
from kvstrata.storage.base import HEADER_NBYTES, StorageConfig, encode_header, header_ok
from kvstrata.storage.config import storage_config
from kvstrata.storage.file_store import FileStore
from kvstrata.storage.sealed import SealedStore
from kvstrata.storage.sealer import SEAL_OVERHEAD, Sealer, read_key_file
from kvstrata.storage.units import PagePart, open_unit_storage
from tests.test_engine_cache import assert_same, conversation, run_turns

SHAPE = KVShape(2, 2, 8, 4, "float16")  # layers, kv heads, head dim, page size, dtype


def key_file(path: Path) -> Path:
    assert main(["keys", "cluster", str(path)]) == 0
    return path


@pytest.mark.parametrize("encrypt", [False, True])
def test_sealer_round_trip_and_every_tampering_fails(encrypt: bool) -> None:
    s = Sealer(os.urandom(32), encrypt)
    unit = np.arange(256, dtype=np.uint8)
    sealed = s.seal(7, unit)
    assert sealed.nbytes == unit.nbytes + SEAL_OVERHEAD
    assert (not np.array_equal(sealed[:256], unit)) == encrypt  # ciphertext only if encrypting
    out = np.zeros_like(unit)
    assert s.open(7, sealed, out) and np.array_equal(out, unit)
    assert not s.open(8, sealed, out)  # moved under another unit key
    assert not Sealer(os.urandom(32), encrypt).open(7, sealed, out)  # another cluster's key
    assert not Sealer(s.key, not encrypt).open(7, sealed, out)  # the other mode
    for at in (0, 255, 260, 280, sealed.nbytes - 1):  # body, tag, salt, nonce
        bad = sealed.copy()
        bad[at] ^= 1
        assert not s.open(7, bad, out)
    reader = Sealer(s.key, encrypt)  # another process: its own salt, reads the writer's units
    assert reader.open(7, sealed, out) and np.array_equal(out, unit)


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_rewritten_unit_with_a_valid_header_is_a_counted_miss(
    tmp_path: Path, encrypt: bool
) -> None:
    cfg = StorageConfig(key_file=str(key_file(tmp_path / "ck")), encrypt=encrypt)
    part = PagePart(SHAPE, (0, 2), (0, 2))
    store = open_unit_storage(f"file://{tmp_path / 'storage'}", part, cfg)
    pages = [
        np.random.default_rng(i).integers(0, 256, part.shape.page_nbytes, np.uint8)
        for i in range(3)
    ]
    assert store.put([11, 12, 13], pages) == 3
    out = [np.zeros_like(p) for p in pages]
    assert store.get([11, 12, 13], out) == 3 and all(map(np.array_equal, out, pages))
    # a writer without the key rewrites one unit of page 12: new bytes, a header that verifies
    victim = next(
        f for f in sorted((tmp_path / "storage").glob("??/*.kvp")) if _holds(f, store, 12)
    )
    raw = bytearray(victim.read_bytes())
    payload = np.frombuffer(bytes(raw[HEADER_NBYTES:]), np.uint8).copy()
    payload[30:60] ^= 0x55
    ukey = int(victim.stem, 16)
    victim.write_bytes(encode_header(ukey, payload) + payload.tobytes())
    assert header_ok(victim.read_bytes()[:HEADER_NBYTES], ukey, payload.nbytes) is not None
    assert store.exists_prefix([11, 12, 13]) == 3  # its marker is there, ...
    assert store.get([11, 12, 13], out) == 1  # ... but it does not open: a miss from page 12
    assert store.stats()["seal_failures"] == 1
    # the sealed read skips the file store's checksum (the tag covers the bytes), yet keeps its
    # clean-up: a unit intact under its checksum stays (it may be another key's), a bit flipped
    # on disk is a miss and the file is removed, as an unsealed store does
    assert victim.exists()
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 1
    victim.write_bytes(bytes(raw))
    assert store.get([11, 12, 13], out) == 1 and store.stats()["seal_failures"] == 2
    assert not victim.exists()
    with pytest.raises(ValueError, match="--storage-key-file"):  # a forgotten key file
        open_unit_storage(f"file://{tmp_path / 'storage'}", part, StorageConfig())
    assert store.get([11], out) == 1  # ... removed nothing
    store.check_integrity()
    store.close()


def _holds(f: Path, store, page: int) -> bool:  # noqa: ANN001
    return int(f.stem, 16) in store.all_unit_keys(page)


def test_store_files_and_directories_are_owner_only(tmp_path: Path) -> None:
    part = PagePart(SHAPE, (0, 2), (0, 2))
    old = os.umask(0o022)
    try:
        store = open_unit_storage(f"file://{tmp_path / 'storage'}", part, StorageConfig())
        store.put([5], [np.zeros(part.shape.page_nbytes, np.uint8)])
        store.close()
    finally:
        os.umask(old)
    made = [p for p in (tmp_path / "storage").rglob("*")] + [tmp_path / "storage"]
    assert len([p for p in made if p.is_file()]) >= 5  # units, commit marker
    for p in made:
        want = 0o700 if p.is_dir() else 0o600
        assert stat.S_IMODE(p.stat().st_mode) == want, p


def test_key_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = key_file(tmp_path / "ck")
    assert stat.S_IMODE(ck.stat().st_mode) == 0o600 and len(read_key_file(ck)) == 32
    assert main(["keys", "cluster", str(ck)]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err
    os.chmod(ck, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_key_file(ck)
    assert main(["keys", "curve", str(tmp_path / "curve"), "srv"]) == 0
    public, secret = zmq.auth.load_certificate(str(tmp_path / "curve" / "srv.key_secret"))
    assert secret is not None and len(public) == 40
    assert stat.S_IMODE((tmp_path / "curve" / "srv.key_secret").stat().st_mode) == 0o600


def test_engine_output_over_a_tampered_sealed_store_equals_the_cold_run(
    tmp_path: Path,
) -> None:
    from kvstrata.model.checkpoint import load_model
    from tests.tiny_models import make_llama

    model = load_model(make_llama(tmp_path / "ckpt", seed=3, max_position_embeddings=1024))
    cfg = StorageConfig(key_file=str(key_file(tmp_path / "ck")))
    prompts = conversation(2)
    cold = run_turns(model, "none", tmp_path / "s0", prompts)
    run_turns(model, "device_host_storage", tmp_path / "storage", prompts[:1], storage_cfg=cfg)
    warm = run_turns(
        model, "device_host_storage", tmp_path / "storage", prompts[:1], storage_cfg=cfg
    )
    assert warm[0].hits["storage"] > 0  # sealed units read back
    for f in (tmp_path / "storage").glob("??/*.kvp"):  # rewrite every unit, headers valid
        payload = np.frombuffer(f.read_bytes()[HEADER_NBYTES:], np.uint8).copy()
        payload[:-SEAL_OVERHEAD] ^= 0x3C  # the bodies
        f.write_bytes(encode_header(int(f.stem, 16), payload) + payload.tobytes())
    after = run_turns(model, "device_host_storage", tmp_path / "storage", prompts, storage_cfg=cfg)
    assert after[0].hits["storage"] == 0
    assert_same(cold, after)


def test_unit_store_cap_counts_what_it_takes_on_disk(tmp_path: Path) -> None:
    """A 400 kB cap on a unit store of small units took 5.6 MB of disk (payload counted only;
    every unit file, marker file and fan-out directory takes a whole block)."""
    cap = 400_000
    part = PagePart(SHAPE, (0, 2), (0, 2))
    root = tmp_path / "storage"
    store = open_unit_storage(f"file://{root}", part, storage_config(max_bytes=cap))
    page = np.zeros(part.shape.page_nbytes, np.uint8)
    for key in range(1, 301):
        assert store.put([key], [page]) == 1
    store.close()
    on_disk = sum(p.stat().st_blocks * 512 for p in root.rglob("*"))
    block = os.statvfs(root).f_frsize
    fixed = 3 * block  # the store's own commits/, pending/ and (empty) nothing else
    assert on_disk <= cap + fixed, on_disk
    assert on_disk >= cap // 2  # it did fill up: the cap, not an empty store, bounds it


@pytest.mark.parametrize("scheme", ["mem", "redis"])
def test_every_backend_gets_sealed_units(tmp_path: Path, scheme: str) -> None:
    """The seal sits in the unit encoding, above the backend: a unit overwritten in the backend
    by a writer without the key (a valid value of the right length) is a counted miss."""
    from kvstrata.storage.units import UnitStorage
    from tests.redis_server import RedisServer

    server = RedisServer().start() if scheme == "redis" else None
    url = server.url if server is not None else "mem://"
    try:
        cfg = StorageConfig(key_file=str(key_file(tmp_path / "ck")))
        part = PagePart(SHAPE, (0, 2), (0, 2))
        store: UnitStorage = open_unit_storage(url, part, cfg)
        page = np.arange(part.shape.page_nbytes, dtype=np.uint64).astype(np.uint8)
        assert store.put([21], [page]) == 1
        out = [np.zeros_like(page)]
        assert store.get([21], out) == 1 and np.array_equal(out[0], page)
        raw = store.units.inner  # the backend under the seal
        forged = np.zeros(raw.page_nbytes, np.uint8)
        assert raw.put(store.all_unit_keys(21)[:1], [forged]) == 1
        assert store.get([21], out) == 0 and store.stats()["seal_failures"] == 1
        if server is not None:
            _redis_tampering_and_a_keyless_reader(store, url, part, page)
        store.close()
    finally:
        if server is not None:
            server.stop()


UNIT = 4096 + 13  # odd: no piece boundary falls on an aligned offset


def _sealed_file_store(root: Path, encrypt: bool, key: bytes) -> SealedStore:
    return SealedStore(FileStore(str(root), UNIT + SEAL_OVERHEAD), Sealer(key, encrypt))


@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_file_units_read_in_place_and_every_tampered_byte_is_a_counted_miss(
    tmp_path: Path, encrypt: bool
) -> None:
    """A sealed file store reads each unit straight into the caller's page (MAC only) or
    decrypts it there from one scratch (encrypt), and puts units as pieces (no joined copy):
    the bytes read equal the bytes written, on disk a MAC'd body is the unit itself, and a
    byte flipped anywhere in the body, tag, salt or nonce is a miss counted in seal_failures
    (the file is removed as corrupt unless a forger gave it a valid header). In the file header
    only the checksum field is not read (the tag covers the bytes): any other byte flipped is a
    corrupt file, removed (but the version field: another format's page, left alone)."""
    key = os.urandom(32)
    store = _sealed_file_store(tmp_path, encrypt, key)
    units = [np.random.default_rng(i).integers(0, 256, UNIT, np.uint8) for i in range(3)]
    assert store.put([1, 2, 3], units) == 3 and store.counts["sealed"] == 3
    out = [np.zeros(UNIT, np.uint8) for _ in units]
    assert store.get([1, 2, 3], out) == 3 and all(map(np.array_equal, out, units))
    f = _unit_file(tmp_path, 2)
    good = f.read_bytes()
    assert len(good) == HEADER_NBYTES + UNIT + SEAL_OVERHEAD
    body = np.frombuffer(good[HEADER_NBYTES : HEADER_NBYTES + UNIT], np.uint8)
    assert np.array_equal(body, units[1]) != encrypt  # MAC only: stored as is
    reader = _sealed_file_store(tmp_path, encrypt, key)  # another process: its own salt
    failures = 0
    for at in (0, UNIT // 2, UNIT - 1, UNIT, UNIT + 15, UNIT + 16, UNIT + 43):
        for reheaded in (False, True):  # a bit flipped on disk / a forger's valid header
            bad = _flipped(good, HEADER_NBYTES + at)
            if reheaded:
                value = np.frombuffer(bad[HEADER_NBYTES:], np.uint8)
                bad = encode_header(2, value) + value.tobytes()
            f.write_bytes(bad)
            corrupt = reader.stats()["corrupt"]
            assert reader.get([1, 2, 3], out) == 1, at  # a miss from unit 2 on
            failures += 1
            assert reader.stats()["seal_failures"] == failures, at
            # a forged value whose checksum holds stays (it may be another key's); a file
            # whose checksum fails too is corrupt and removed, as in an unsealed store
            assert reader.stats()["corrupt"] == corrupt + (not reheaded), at
            assert f.exists() == reheaded, at
    for at in range(HEADER_NBYTES):
        f.write_bytes(_flipped(good, at))
        if 16 <= at < 24:  # the xxh3 field: not read under a seal, the bytes are authentic
            assert reader.get([2], out[1:2]) == 1 and np.array_equal(out[1], units[1])
            continue
        before = {k: reader.stats()[k] for k in ("corrupt", "foreign")}
        assert reader.get([1, 2, 3], out) == 1, at
        # the version field: another format's intact page (a miss that stays); magic, lengths
        # or key: corrupt (removed)
        outcome = "foreign" if 4 <= at < 6 else "corrupt"
        assert reader.stats()[outcome] == before[outcome] + 1, at
        assert f.exists() == (outcome == "foreign"), at
    assert reader.stats()["seal_failures"] == failures
    f.write_bytes(good)
    assert reader.get([1, 2, 3], out) == 3 and all(map(np.array_equal, out, units))
    reader.check_integrity()
    store.close()
    reader.close()


def test_a_store_of_another_size_or_a_sealed_one_read_without_the_key_is_left_alone(
    tmp_path: Path,
) -> None:
    """A file whose intact header names another page size (a sealed store's units read without
    the key, or plain pages read with it) is a miss counted as foreign, never removed."""
    sealed = _sealed_file_store(tmp_path, False, os.urandom(32))
    unit = np.arange(UNIT, dtype=np.uint16).astype(np.uint8)
    assert sealed.put([5], [unit]) == 1
    plain = FileStore(str(tmp_path), UNIT)
    out = [np.zeros(UNIT, np.uint8)]
    assert plain.exists_prefix([5]) == 0 and plain.get([5], out) == 0
    assert plain.stats()["foreign"] == 1 and plain.stats()["corrupt"] == 0
    assert sealed.get([5], out) == 1 and np.array_equal(out[0], unit)
    assert plain.put([6], [unit]) == 1  # and the other way round
    assert sealed.get([6], out) == 0 and sealed.stats()["foreign"] == 1
    assert sealed.stats()["seal_failures"] == 0
    assert plain.get([6], out) == 1 and np.array_equal(out[0], unit)
    truncated = _unit_file(tmp_path, 6)  # a header that disagrees with the file's size
    truncated.write_bytes(truncated.read_bytes()[:-1])
    assert sealed.get([6], out) == 0 and not truncated.exists()
    assert sealed.stats()["corrupt"] == 1
    sealed.check_integrity()  # another store's files in its directory are not a breach
    plain.check_integrity()
    sealed.close()
    plain.close()


def _unit_file(root: Path, key: int) -> Path:
    from kvstrata.cache.keys import key_hex

    h = key_hex(key)
    return root / h[:2] / f"{h}.kvp"


def _flipped(data: bytes, at: int) -> bytes:
    raw = bytearray(data)
    raw[at] ^= 0x10
    return bytes(raw)


def _redis_tampering_and_a_keyless_reader(store, url: str, part: PagePart, page) -> None:  # noqa: ANN001
    """Redis under a seal: checked by the tag, not xxh3. A value rewritten with a valid header
    is a seal failure and stays; a bit flipped on the server fails xxh3 too: removed. A store
    opened without the key refuses to start (the store is marked sealed)."""
    raw = store.units.inner
    assert store.put([22], [page]) == 1
    ukey = store.all_unit_keys(22)[0]
    value = raw._client.get(raw._name(ukey))
    assert len(value) == HEADER_NBYTES + store.units.page_nbytes + SEAL_OVERHEAD
    out = [np.zeros_like(page)]
    with pytest.raises(ValueError, match="--storage-key-file"):
        open_unit_storage(url, part, StorageConfig())
    assert store.get([22], out) == 1 and np.array_equal(out[0], page)
    flipped = bytearray(value)
    flipped[HEADER_NBYTES + 5] ^= 1  # a body byte
    raw._client.set(raw._name(ukey), bytes(flipped))
    failures = store.stats()["seal_failures"]
    assert store.get([22], out) == 0 and store.stats()["seal_failures"] == failures + 1
    assert raw._client.get(raw._name(ukey)) is None  # corrupt (xxh3 fails too): removed
    payload = np.frombuffer(bytes(flipped[HEADER_NBYTES:]), np.uint8)
    raw._client.set(raw._name(ukey), encode_header(ukey, payload) + payload.tobytes())
    assert store.get([22], out) == 0 and store.stats()["seal_failures"] == failures + 2
    assert raw._client.get(raw._name(ukey)) is not None  # intact under its checksum: stays

"""The unit checks a sealed get builds once (Sealer.mac_check / decrypt_check over SealTail views):
they open exactly the units sealed under their unit key, byte-equal; any one byte of a stored
value changed, another unit key, another cluster key or the other mode fails (and is reported
once); units of several writers (salts) in one batch all open. Through a file store: every byte
of a stored unit flipped on disk is a counted miss, and a unit moved under another key with a
valid header is one too."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvstrata.cache.keys import key_hex
from kvstrata.storage.base import HEADER_NBYTES, encode_header
from kvstrata.storage.file_store import FileStore
from kvstrata.storage.sealed import SealedStore
from kvstrata.storage.sealer import SEAL_OVERHEAD, TAG, Sealer, seal_tail

N = 61  # odd: the tail starts at an unaligned offset


def _check(sealer: Sealer, keys: list[int], values: list[np.ndarray], failed: list[int]):  # noqa: ANN202
    """The check a get builds for `values` (n + 44 bytes each, read as a store reads them), and
    the unit bytes it leaves (MAC only: the body in place; encrypt: decrypted into `outs`)."""
    views = [memoryview(v) for v in values]
    tails = [seal_tail(v[N:]) for v in views]
    if not sealer.encrypt:
        bodies = [v[:N] for v in views]
        return sealer.mac_check(keys, bodies, tails, N, failed.append), bodies
    outs = [memoryview(np.zeros(N, np.uint8)) for _ in values]
    body = [v[: N + TAG] for v in views]
    return sealer.decrypt_check(keys, body, tails, outs, failed.append), outs


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_built_check_opens_exactly_the_sealed_units(encrypt: bool) -> None:
    key = os.urandom(32)
    writers = [Sealer(key, encrypt), Sealer(key, encrypt)]  # two processes: two salts
    units = [np.random.default_rng(i).integers(0, 256, N, np.uint8) for i in range(5)]
    keys = [11, 12, 13, 14, 15]
    # writers alternate within the batch: the reader's last-salt key must follow them
    sealed = [writers[i % 2].seal(k, u) for i, (k, u) in enumerate(zip(keys, units, strict=True))]
    reader, failed = Sealer(key, encrypt), []
    check, got = _check(reader, keys, [s.copy() for s in sealed], failed)
    assert [check(i) for i in range(5)] == [True] * 5 and failed == []
    assert all(
        np.array_equal(np.frombuffer(g, np.uint8), u) for g, u in zip(got, units, strict=True)
    )
    # the writer reading its own units (its own salt), twice: same answers
    check, _ = _check(writers[0], keys, [s.copy() for s in sealed], failed)
    assert [check(i) for i in (0, 2, 4, 0)] == [True] * 4 and failed == []
    for at in range(N + SEAL_OVERHEAD):  # every byte: body, tag, salt, nonce
        bad = sealed[2].copy()
        bad[at] ^= 0x01
        check, _ = _check(reader, keys[2:3], [bad], failed)
        assert not check(0), at
    assert failed == [0] * (N + SEAL_OVERHEAD)
    failed.clear()
    check, _ = _check(reader, [12, 11], [s.copy() for s in sealed[:2]], failed)
    assert not check(0) and not check(1) and failed == [0, 1]  # another unit key each
    for other in (Sealer(os.urandom(32), encrypt), Sealer(key, not encrypt)):
        failed.clear()
        check, _ = _check(other, keys[:1], [sealed[0].copy()], failed)
        assert not check(0) and failed == [0]


@pytest.mark.parametrize("encrypt", [False, True])
def test_every_flipped_byte_of_a_stored_unit_is_a_counted_miss(
    tmp_path: Path, encrypt: bool
) -> None:
    key = os.urandom(32)
    writer = SealedStore(FileStore(str(tmp_path), N + SEAL_OVERHEAD), Sealer(key, encrypt))
    reader = SealedStore(FileStore(str(tmp_path), N + SEAL_OVERHEAD), Sealer(key, encrypt))
    units = [np.random.default_rng(i).integers(0, 256, N, np.uint8) for i in range(3)]
    assert writer.put([1, 2, 3], units) == 3
    out = [np.zeros(N, np.uint8) for _ in units]
    assert reader.get([1, 2, 3], out) == 3
    assert all(np.array_equal(o, u) for o, u in zip(out, units, strict=True))
    h = key_hex(2)
    f = tmp_path / h[:2] / f"{h}.kvp"
    good = f.read_bytes()
    for at in range(HEADER_NBYTES, len(good)):  # every stored byte after the header
        raw = bytearray(good)
        raw[at] ^= 0x80
        f.write_bytes(bytes(raw))
        assert reader.get([1, 2, 3], out) == 1, at  # unit 1 read, a miss from unit 2 on
        assert reader.stats()["seal_failures"] == at - HEADER_NBYTES + 1, at
    # unit 2's value under unit 3's name with a valid header (a forger moving units): a miss
    value = np.frombuffer(good[HEADER_NBYTES:], np.uint8)
    h3 = key_hex(3)
    (tmp_path / h3[:2] / f"{h3}.kvp").write_bytes(encode_header(3, value) + value.tobytes())
    f.write_bytes(good)
    before = reader.stats()["seal_failures"]
    assert reader.get([1, 2, 3], out) == 2 and reader.stats()["seal_failures"] == before + 1
    assert all(np.array_equal(o, u) for o, u in zip(out[:2], units[:2], strict=True))
    reader.check_integrity()
    writer.close()
    reader.close()

"""A sealed file store checks each unit on a second thread while the next is read: the same
units, bytes, misses, counters and files as the serial read-then-check, whatever goes wrong in
the middle of a batch (a forged unit, a flipped bit, a missing file, a broken header, another
store's unit), including bad units read ahead past the first miss (never acted on)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvstrata.cache.keys import key_hex
from kvstrata.storage.base import HEADER_NBYTES, encode_header
from kvstrata.storage.file_store import FileStore
from kvstrata.storage.sealed import CHECK_GROUP_BYTES, SealedStore
from kvstrata.storage.sealer import SEAL_OVERHEAD, Sealer

UNIT = 64 * 1024 + 13  # odd: no piece boundary falls on an aligned offset
GROUP = CHECK_GROUP_BYTES // (UNIT + SEAL_OVERHEAD)  # units per check task (7)
KEYS = list(range(1, 4 * GROUP + 1))
BAD = GROUP + 3  # in the second group: the first group passed, the third is read ahead
COUNTERS = ("seal_failures", "corrupt", "foreign", "read_errors", "get_hits", "get_misses")


def _file(root: Path, key: int) -> Path:
    h = key_hex(key)
    return root / h[:2] / f"{h}.kvp"


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x20
    path.write_bytes(bytes(raw))


def _forge(path: Path, key: int) -> None:
    value = np.frombuffer(path.read_bytes()[HEADER_NBYTES:], np.uint8).copy()
    value[7] ^= 1
    path.write_bytes(encode_header(key, value) + value.tobytes())


def _damage(root: Path, how: str) -> None:
    """Unit BAD damaged `how`; two units read ahead of it (its group's, the next group's)
    damaged too."""
    five = _file(root, BAD)
    if how == "forged":  # a valid header over other bytes: fails the seal, stays
        _forge(five, BAD)
    elif how == "flipped":  # fails the seal and the checksum: removed
        _flip(five, HEADER_NBYTES + 100)
    elif how == "missing":
        five.unlink()
    elif how == "header":  # the key field: corrupt at read time
        _flip(five, 30)
    elif how == "foreign":  # another format version: a miss that stays
        _flip(five, 4)
    if how != "none":
        _flip(_file(root, BAD + 2), HEADER_NBYTES + 5)  # fails its check, past the miss
        _flip(_file(root, BAD + GROUP), 30)  # corrupt at read time, past the miss


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("how", ["none", "forged", "flipped", "missing", "header", "foreign"])
def test_overlapped_sealed_reads_equal_serial_ones(tmp_path: Path, encrypt: bool, how: str) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("the check thread runs only with a second core")
    key = os.urandom(32)
    units = [np.random.default_rng(k).integers(0, 256, UNIT, np.uint8) for k in KEYS]
    writer = SealedStore(FileStore(str(tmp_path / "a"), UNIT + SEAL_OVERHEAD), Sealer(key, encrypt))
    assert writer.put(KEYS, units) == len(KEYS)
    writer.close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    readers = {}
    for side, overlap in (("a", False), ("b", True)):
        _damage(tmp_path / side, how)
        inner = FileStore(str(tmp_path / side), UNIT + SEAL_OVERHEAD)
        readers[side] = SealedStore(inner, Sealer(key, encrypt), overlap=overlap)
    assert readers["a"]._verifier is None and readers["b"]._verifier is not None
    got = {}
    for side, reader in readers.items():
        out = [np.zeros(UNIT, np.uint8) for _ in KEYS]
        n = reader.get(KEYS, out)
        assert all(np.array_equal(o, u) for o, u in zip(out[:n], units[:n], strict=True))
        st = reader.stats()
        files = sorted(p.relative_to(tmp_path / side) for p in (tmp_path / side).rglob("*.kvp"))
        got[side] = (n, {c: st[c] for c in COUNTERS}, files)
        reader.check_integrity()
    assert got["a"] == got["b"]
    n, counts, files = got["b"]
    assert n == (len(KEYS) if how == "none" else BAD - 1)  # then the miss at BAD
    assert counts["seal_failures"] == int(how in ("forged", "flipped"))
    assert len(files) == len(KEYS) - int(how in ("flipped", "missing", "header"))
    assert GROUP >= 2 and len(KEYS) * (UNIT + SEAL_OVERHEAD) > CHECK_GROUP_BYTES  # overlapped
    for reader in readers.values():
        again = [np.zeros(UNIT, np.uint8) for _ in KEYS]
        assert reader.get(KEYS[: BAD - 1], again[: BAD - 1]) == BAD - 1  # still serving
        reader.close()

"""A store that heals: a unit failing its seal is rewritten by the next backup (file: the write
path checks the seal; redis: every write overwrites), a key rotation only misses once, keyless
and keyed writers never share a store, names in a sealed store are keyed, only bytes actually
written count as moved, and /metrics counts seal failures, corrupt units and rewrites."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.counters import CacheCounters
from kvstrata.cache.keys import key_hex, page_keys
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.memory.layout import KVShape
from kvstrata.model.checkpoint import load_model
from kvstrata.serve.metrics import ServeMetrics, engine_stats
from kvstrata.storage.base import HEADER_NBYTES, StorageConfig, encode_header
from kvstrata.storage.unit_sweep import pending_key
from kvstrata.storage.units import PagePart, UnitStorage, open_unit_storage
from tests.test_engine_cache import assert_same, conversation
from tests.test_storage_sealed import key_file

torch.set_num_threads(1)
SHAPE = KVShape(2, 2, 8, 4, "float16")  # layers, kv heads, head dim, page size, dtype
PART = PagePart(SHAPE, (0, 2), (0, 2))  # one rank: 4 units of 1 layer x 1 head per page
UNITS = 4
PAGE = 8
CKPT = {"seed": 3, "max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def model(ckpt: Path):  # noqa: ANN201
    return load_model(ckpt)


@pytest.fixture(params=["file", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        yield f"file://{tmp_path / 'storage'}"
        return
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()


def pages(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PART.shape.page_nbytes, np.uint8) for _ in range(n)]


def forge(store: UnitStorage, ukey: int) -> None:
    """Replace one stored unit by other bytes under a valid header (xxh3 holds, the seal not),
    as a writer without the key (or one with another key) would."""
    raw = store.units.inner  # the backend under the seal
    value = np.random.default_rng(ukey % 1000).integers(0, 256, raw.page_nbytes, np.uint8)
    if store.backend == "file":
        path = Path(raw._path(ukey))
        path.write_bytes(encode_header(ukey, value) + value.tobytes())
    else:
        assert raw.put([ukey], [value]) == 1


def test_a_unit_failing_its_seal_is_rewritten_by_the_next_backup(url: str, tmp_path: Path) -> None:
    cfg = StorageConfig(key_file=str(key_file(tmp_path / "ck")))
    store = open_unit_storage(url, PART, cfg)
    data = pages(3)
    page, unit = PART.shape.page_nbytes, PART.shape.page_nbytes // UNITS
    first = store.put_report([1, 2, 3], data)
    assert (first.stored, first.written_bytes) == (3, 3 * page)
    again = store.put_report([1, 2, 3], data)  # the file store keeps units whose seal opens
    assert again.stored == 3
    assert again.written_bytes == (0 if store.backend == "file" else 3 * page)
    forge(store, store.all_unit_keys(2)[1])
    out = [np.zeros(page, np.uint8) for _ in data]
    assert store.exists_prefix([1, 2, 3]) == 3 and store.get([1, 2, 3], out) == 1
    assert store.stats()["seal_failures"] == 1 and store.stats()["rewrites"] == 0
    healed = store.put_report([2], data[1:2])
    assert healed.stored == 1
    st = store.stats()
    assert st["rewrites"] == 1
    if store.backend == "file":  # the write path read every unit of page 2 and found one bad
        assert healed.written_bytes == unit and st["seal_failures"] == 2
    else:  # redis overwrites every unit it is given
        assert healed.written_bytes == page and st["seal_failures"] == 1
    assert store.get([1, 2, 3], out) == 3 and all(map(np.array_equal, out, data))
    assert store.stats()["corrupt"] == 0
    store.check_integrity()
    store.close()


def test_keyless_and_keyed_writers_never_share_a_store(url: str, tmp_path: Path) -> None:
    """A keyless store opens beside plain units only; once a keyed writer marked the store it
    refuses to start, naming the key option. The keyed writer's names are its own: it neither
    reads nor overwrites the plain units written before it came."""
    plain = open_unit_storage(url, PART, StorageConfig())
    data = pages(2, seed=1)
    assert plain.put([7, 8], data) == 2
    cfg = StorageConfig(key_file=str(key_file(tmp_path / "ck")))
    sealed = open_unit_storage(url, PART, cfg)
    assert sealed.exists_prefix([7, 8]) == 0  # the plain pages are not its pages
    assert sealed.put([7], pages(1, seed=2)) == 1
    out = [np.zeros(PART.shape.page_nbytes, np.uint8) for _ in data]
    assert plain.get([7, 8], out) == 2 and all(map(np.array_equal, out, data))  # untouched
    with pytest.raises(ValueError, match=r"holds sealed units.*--storage-key-file"):
        open_unit_storage(url, PART, StorageConfig())
    assert sealed.stats()["seal_failures"] == 0 and sealed.stats()["rewrites"] == 0
    for s in (plain, sealed):
        s.check_integrity()
        s.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_store_names_are_keyed(url: str, tmp_path: Path, encrypt: bool) -> None:
    """Listing a sealed store shows no name computed from a page key without the cluster key:
    no unit, commit marker or pending record of the plain names."""
    cfg = StorageConfig(key_file=str(key_file(tmp_path / "ck")), encrypt=encrypt)
    store = open_unit_storage(url, PART, cfg)
    key = 0x1234_5678_9ABC_DEF0_0FED_CBA9_8765_4321
    assert store.put([key], pages(1)) == 1
    lay = store.layout
    plain = {lay.unit_key(key, b) for b in store.all_blocks}
    plain |= {lay.commit_key(key), pending_key(key)}
    listed = _listed_names(store, tmp_path)
    assert listed and not {key_hex(k) for k in plain} & listed
    assert {key_hex(u) for u in store.all_unit_keys(key)} <= listed  # its keyed units
    store.close()


def _listed_names(store: UnitStorage, tmp_path: Path) -> set[str]:
    """Every name in the store: file stems, or redis keys less their prefix."""
    if store.backend == "file":
        return {p.stem for p in (tmp_path / "storage").rglob("*.kvp")}
    client = store.units.inner._client
    return {k.decode().rsplit(":", 1)[1] for k in client.keys("*")}


def _run(model, url: str, cfg: StorageConfig, prompt: list[int]) -> Run:  # noqa: ANN001
    """One fresh engine over the store: its request and its counters (and /metrics text)."""
    built = build_engine(
        EngineConfig(chunk_tokens=1024, max_batch_tokens=1024),
        CacheConfig(
            page_size=PAGE,
            device_pages=64,
            host_pages=64,
            storage_url=url,
            prefetch_policy="wait_complete",
        ),
        cfg,
        model=model,
    )
    eng = built.engine
    req = Request("r", prompt, max_new_tokens=4, keep_logits=True)
    eng.submit(req)
    while eng.has_work():
        eng.step()
    eng.drain()
    eng.check_integrity()
    metrics = ServeMetrics("m")
    metrics.attach(lambda: engine_stats(eng), eng.page)
    text = generate_latest(metrics.registry).decode()
    assert eng.cache is not None
    counters = eng.cache.counters
    run = Run(req, counters, text, page_keys(prompt, eng.kv.ns, eng.kv.vocab_size), eng.pool.shape)
    built.close()
    return run


@dataclass
class Run:
    req: Request
    counters: CacheCounters
    metrics: str
    keys: list[int]  # the prompt's page keys
    shape: KVShape  # the engine's page shape


def _metric(text: str, name: str, backend: str = "file") -> float:
    want = f'kvstrata:{name}_total{{backend="{backend}",model_name="m"}}'
    line = next(ln for ln in text.splitlines() if ln.startswith(want))
    return float(line.rsplit(" ", 1)[1])


def test_key_rotation_misses_once_then_hits(model, tmp_path: Path) -> None:  # noqa: ANN001
    """Units sealed under key A are a miss under key B (B's names differ: nothing is read,
    nothing rewritten); B's first run writes its own units, its second run hits them."""
    url = f"file://{tmp_path / 'storage'}"
    prompt = conversation(1)[0]
    key_a = StorageConfig(key_file=str(key_file(tmp_path / "a")))
    key_b = StorageConfig(key_file=str(key_file(tmp_path / "b")))
    a = _run(model, url, key_a, prompt)
    backed = a.counters.pages_moved["host->storage"]
    assert backed == (len(prompt) + 4 - 1) // PAGE  # the KV of every token but the last
    b1 = _run(model, url, key_b, prompt)
    assert b1.req.hits["storage"] == 0 and b1.counters.pages_moved["host->storage"] == backed
    assert b1.counters.bytes_moved["host->storage"] == backed * b1.counters.page_nbytes
    assert _metric(b1.metrics, "storage_seal_failures") == 0
    assert _metric(b1.metrics, "storage_unit_rewrites") == 0
    b2 = _run(model, url, key_b, prompt)
    hits = (len(prompt) - 1) // PAGE  # the prompt's pages (its last token is computed)
    assert b2.req.hits["storage"] == hits
    # the pages past the hits were computed again and backed up: stored already, kept
    assert b2.counters.pages_moved["host->storage"] == backed - hits
    assert b2.counters.bytes_moved["host->storage"] == 0
    assert_same([a.req], [b1.req])
    assert_same([a.req], [b2.req])


def test_metrics_count_seal_failures_corrupt_units_and_rewrites_exactly(
    model,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    """A unit of page 0 forged (valid header, bad seal) and a unit of page 1 with a bit flipped
    on disk: the prefetch stops at page 0 (one seal failure); the next backup reads every
    stored unit, finds both bad (two more; page 1's fails its checksum too: corrupt) and
    rewrites exactly those two units, which are all the bytes it moves."""
    url = f"file://{tmp_path / 'storage'}"
    prompt = conversation(1)[0]
    cfg = StorageConfig(key_file=str(key_file(tmp_path / "ck")))
    cold = _run(model, url, cfg, prompt)
    store = open_unit_storage(url, PagePart(cold.shape, *_whole(cold.shape)), cfg)
    forge(store, store.all_unit_keys(cold.keys[0])[0])
    flipped = Path(store.units.inner._path(store.all_unit_keys(cold.keys[1])[-1]))
    raw = bytearray(flipped.read_bytes())
    raw[HEADER_NBYTES + 3] ^= 1
    flipped.write_bytes(bytes(raw))
    unit = store.layout.unit_nbytes
    store.close()
    after = _run(model, url, cfg, prompt)
    assert after.req.hits["storage"] == 0
    assert _metric(after.metrics, "storage_seal_failures") == 3
    assert _metric(after.metrics, "storage_corrupt_units") == 1
    assert _metric(after.metrics, "storage_unit_rewrites") == 2
    backed = (len(prompt) + 4 - 1) // PAGE
    assert after.counters.pages_moved["host->storage"] == backed
    assert after.counters.bytes_moved["host->storage"] == 2 * unit
    moved = 'kvstrata:kv_moved_bytes_total{direction="host->storage",model_name="m"}'
    assert f"{moved} {float(2 * unit)}" in after.metrics.splitlines()
    healed = _run(model, url, cfg, prompt)
    assert healed.req.hits["storage"] == (len(prompt) - 1) // PAGE
    assert _metric(healed.metrics, "storage_seal_failures") == 0
    assert_same([cold.req], [after.req])
    assert_same([cold.req], [healed.req])


def _whole(shape: KVShape) -> tuple[tuple[int, int], tuple[int, int]]:
    return (0, shape.num_layers), (0, shape.num_kv_heads)


def test_moved_bytes_count_only_bytes_written(model, tmp_path: Path) -> None:  # noqa: ANN001
    """A backup of pages whose units are stored already (their commit markers lost, as after a
    rank killed before the commit) writes the markers only: no byte counts as moved."""
    url = f"file://{tmp_path / 'storage'}"
    prompt = conversation(1)[0]
    cold = _run(model, url, StorageConfig(), prompt)
    backed = (len(prompt) + 4 - 1) // PAGE
    assert cold.counters.bytes_moved["host->storage"] == backed * cold.counters.page_nbytes
    for marker in (tmp_path / "storage" / "commits").rglob("*.kvp"):
        marker.unlink()
    again = _run(model, url, StorageConfig(), prompt)
    assert again.req.hits["storage"] == 0
    assert again.counters.pages_moved["host->storage"] == backed
    assert again.counters.bytes_moved["host->storage"] == 0
    assert again.counters.bytes_moved["device->host"] == cold.counters.bytes_moved["device->host"]
    assert_same([cold.req], [again.req])

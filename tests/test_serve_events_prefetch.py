"""KV events of a storage prefetch: pages a prefetch lands in host memory for a waiting request
are announced with their tokens and cache_salt (the engine's StepResult says what they hold), as
are the pages requests compute; every BlockStored names its parent page and carries each page's
tokens in order, under both wire formats (the array format carries no salts)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.event_wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvstrata.cache.events import block_hash
from kvstrata.engine.build import Built, build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.engine.step_io import Call, NewRequest, StepInputs
from kvstrata.engine.step_result import PagesCached, StepResult
from kvstrata.model.checkpoint import load_model
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.events import KVEventPublisher
from kvstrata.serve.step_loop import StepLoop

CKPT = {"seed": 5, "max_position_embeddings": 256}
PAGE = 8
SALT = "tenant-a"
STORED = [(3 + 13 * i) % 97 for i in range(33)]  # 4 full pages reach storage in the first run
FOLLOW = STORED + [(5 + 7 * i) % 97 for i in range(11)]  # those 4 pages + 1 computed page
OTHER = [(11 + 17 * i) % 97 for i in range(20)]  # unsalted, computed while FOLLOW waits


def _engine(ckpt: Path, store: Path) -> Built:
    cache = CacheConfig(page_size=PAGE, device_pages=32, host_pages=32, storage_url=str(store))
    return build_engine(
        EngineConfig(chunk_tokens=16, max_batch_tokens=32), cache, model=load_model(ckpt)
    )


def _settled(built: Built) -> None:
    """Wait until every pending copy finished on this rank: each step then applies them all."""
    cache, mover = built.engine.cache, built.mover
    assert cache is not None and mover is not None
    ops = [op for queue in cache.queues.pending.values() for op in queue]
    deadline = time.monotonic() + 30
    while any(mover.poll(op) is None for op in ops):
        assert time.monotonic() < deadline, "cache copies still pending after 30 s"
        time.sleep(0.001)


def _reset(engine: object) -> bool:
    return engine.reset_prefix_cache()  # type: ignore[attr-defined]


@pytest.mark.parametrize("fmt", ["vllm", "array"])
def test_prefetched_pages_are_announced_with_their_tokens_and_salt(
    fmt: str, ckpt: Path, tmp_path: Path
) -> None:
    first = _engine(ckpt, tmp_path / "store")
    first.engine.run([Request("seed", STORED, 2, cache_salt=SALT)])
    first.close()  # the backups of its 4 full pages reach storage
    built = _engine(ckpt, tmp_path / "store")
    eng = built.engine
    cfg = ServeConfig(kv_events_endpoint="tcp://127.0.0.1:*", kv_events_format=fmt)
    pub = KVEventPublisher(cfg, PAGE)
    loop = StepLoop(eng, None, events=pub)
    results: list[StepResult] = []
    step = eng.step

    def recorded() -> StepResult:
        results.append(step())
        return results[-1]

    eng.step = recorded  # type: ignore[method-assign]
    inputs = [
        StepInputs(new=[NewRequest("other", OTHER, 3)], step=True),
        StepInputs(new=[NewRequest("follow", FOLLOW, 3, cache_salt=SALT)], step=True),
        *[StepInputs(step=True) for _ in range(12)],
        StepInputs(calls=[Call(1, _reset)]),  # host and storage copies are announced again
    ]
    try:
        for msg in inputs:
            _settled(built)
            loop.apply(msg)
        assert not eng.has_work()
        eng.check_integrity()
        batches = [decode_batch(payload).events for _, payload in pub.buffer.since(0)]
    finally:
        pub.close()
        built.close()
    keys = {
        "f": eng.kv.seq_keys(Request("f", FOLLOW, 1, cache_salt=SALT), FOLLOW),
        "o": eng.kv.seq_keys(Request("o", OTHER, 1), OTHER),
    }
    tokens = {"f": FOLLOW, "o": OTHER}
    name = {block_hash(k): f"{r}{i}" for r, ks in keys.items() for i, k in enumerate(ks)}

    def expect(label: str) -> tuple[list[int], str]:
        r, i = label[0], int(label[1:])
        return tokens[r][i * PAGE : (i + 1) * PAGE], SALT if r == "f" else ""

    seen = []
    for n, batch in enumerate(batches):
        for e in batch:
            if isinstance(e, AllBlocksCleared):
                seen.append((n, "cleared"))
                continue
            labels = [name[h] for h in e.block_hashes]
            if isinstance(e, BlockRemoved):
                seen.append((n, "removed", e.medium, labels))
                continue
            assert isinstance(e, BlockStored)
            pages = [expect(label) for label in labels]
            assert e.token_ids == [t for toks, _ in pages for t in toks], labels
            said = [salt if fmt == "vllm" else "" for _, salt in pages]  # array: no salts
            assert e.salts == said, labels
            assert e.block_size == PAGE
            first = labels[0]
            parent = None if first[1:] == "0" else f"{first[0]}{int(first[1:]) - 1}"
            assert (
                name[e.parent_block_hash] if e.parent_block_hash is not None else None
            ) == parent
            seen.append((n, "stored", e.medium, labels))
    f4, o2 = ["f0", "f1", "f2", "f3"], ["o0", "o1"]
    assert seen == [
        (0, "stored", "GPU", o2),
        (1, "stored", "CPU", o2),  # a publish while "follow" waits on storage
        (2, "stored", "GPU", f4),  # landed by the prefetch, loaded at its admission
        (2, "stored", "CPU", f4),
        (2, "stored", "DISK", f4),
        (2, "stored", "GPU", ["f4"]),
        (2, "stored", "DISK", o2),
        (3, "stored", "CPU", ["f4"]),
        (4, "stored", "DISK", ["f4"]),
        (5, "cleared"),
        (5, "stored", "CPU", f4),
        (5, "stored", "DISK", f4),
        (5, "stored", "CPU", ["f4"]),
        (5, "stored", "DISK", ["f4"]),
        (5, "stored", "CPU", o2),
        (5, "stored", "DISK", o2),
    ]
    # the step the prefetch landed in says so first: its pages, before the request's match
    salted = [pages for result in results for pages in result.cached if pages.salt]
    assert salted[0] == PagesCached(keys["f"][:4], FOLLOW[: 4 * PAGE], SALT)

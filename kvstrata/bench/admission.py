"""`kvstrata bench admission`: TTFT of device-hit requests queued behind one long storage prefetch.

One run, the same requests twice: with `admission_lookahead=1` (the head of the queue blocks
everything behind it while it waits on storage: the old behaviour) and with the default
lookahead (ready requests behind it go first). A random small Llama (no download) serves:
  1. a warm-up engine computes a long prompt and backs it up to a file store;
  2. a fresh engine sharing that store, whose reads are slowed to `READ_S_PER_PAGE` (remote
     storage), first serves the short prompts once (they are now in its device memory), then gets
     the long prompt (a storage hit: probe + prefetch) followed by the short prompts again (device
     hits).
Reported: TTFT p50 of the short device-hit requests and the long request's TTFT, per lookahead, and
their ratio (after / before) measured in this run.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvstrata.bench.registry import BENCHES
from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM
from kvstrata.model.random_checkpoint import make_random_llama
from kvstrata.storage.base import StorageConfig

PAGE = 64
READ_S_PER_PAGE = 0.01  # a 20 MB page of a 70B-class model over a 2 GB/s link


def _prompts(quick: bool, vocab: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(0)
    long_pages, n_short = (24, 3) if quick else (64, 6)
    long = [rng.randrange(vocab) for _ in range(long_pages * PAGE + 1)]
    shorts = [[rng.randrange(vocab) for _ in range(2 * PAGE + 1)] for _ in range(n_short)]
    return long, shorts


def _engine(model: DecoderLM, path: Path, store: Path, lookahead: int, slow: bool) -> Any:
    ecfg = EngineConfig(model=str(path), max_running=8, admission_lookahead=lookahead)
    ccfg = CacheConfig(
        page_size=PAGE, device_pages=256, host_pages=256, storage_url=f"file://{store}"
    )
    scfg = StorageConfig(emulate_read_s_per_page=READ_S_PER_PAGE if slow else 0.0)
    return build_engine(ecfg, ccfg, scfg, model=model)


def _one(model: DecoderLM, path: Path, store: Path, lookahead: int, quick: bool) -> dict:
    long, shorts = _prompts(quick, model.vocab_size)
    warm = _engine(model, path, store, lookahead, slow=False)
    warm.engine.run([Request("warm", long, 1)])
    warm.close()  # drains the storage backups
    built = _engine(model, path, store, lookahead, slow=True)
    eng = built.engine
    eng.run([Request(f"s{i}", t, 1) for i, t in enumerate(shorts)])
    eng.drain()
    head = Request("long", long, 1)
    behind = [Request(f"again{i}", t, 1) for i, t in enumerate(shorts)]
    eng.run([head, *behind])
    eng.check_integrity()
    built.close()
    assert head.hits["storage"] > 0 and all(r.hits["device"] == 2 for r in behind)
    return {
        "device_hit_ttft_p50_s": statistics.median(r.ttft_s for r in behind),
        "long_ttft_s": head.ttft_s,
        "long_storage_pages": head.hits["storage"],
    }


@BENCHES.register("admission")
def bench_admission(quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-admission-") as tmp:
        path = make_random_llama(Path(tmp) / "model")
        model = load_model(path)
        before = _one(model, path, Path(tmp) / "store1", 1, quick)
        after = _one(model, path, Path(tmp) / "store4", EngineConfig.admission_lookahead, quick)
    return {
        "device_hit_ttft_p50_s_head_blocks": before["device_hit_ttft_p50_s"],
        "device_hit_ttft_p50_s_lookahead": after["device_hit_ttft_p50_s"],
        "device_hit_ttft_ratio": after["device_hit_ttft_p50_s"] / before["device_hit_ttft_p50_s"],
        "long_ttft_s_head_blocks": before["long_ttft_s"],
        "long_ttft_s_lookahead": after["long_ttft_s"],
        "long_storage_pages": after["long_storage_pages"],
        "read_s_per_page": READ_S_PER_PAGE,
    }

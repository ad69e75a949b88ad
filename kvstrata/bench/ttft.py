"""`kvstrata bench ttft`: TTFT of a long prompt whose prefix is cached in device, host or storage,
over the cold TTFT of the same prompt, on the real SmolLM2 model, in one run.

One cold prefill (a device_host_storage engine over an empty file store) fills every tier: device in
place, host by write-through, storage by backup. Then the same prompt again on that engine is a
device hit; after every cached device page is forced out (demotion) it is a host hit; on a fresh
engine sharing the file store it is a storage hit. The prefix is all but the last page (the page
holding the last prompt token is always computed). Goals: device <= 0.05, host <= 0.10, storage
<= 0.20 of cold.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvstrata.bench.registry import BENCHES
from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import Built, build_engine, resolve_model_path
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM

PAGE = 64
GOALS = {"device_ratio": 0.05, "host_ratio": 0.10, "storage_ratio": 0.20}


def _serve(eng: Engine, tokens: list[int], rid: str) -> Request:
    """Run one prompt to its first token alone on `eng`; the engine is idle afterwards."""
    req = Request(rid, tokens, max_new_tokens=1)
    eng.submit(req)
    while eng.has_work():
        eng.step()
    eng.drain()  # write-through / backup copies done: the next measurement starts settled
    eng.check_integrity()
    return req


def _demote(eng: Engine, device_pages: int) -> None:
    """Force every cached page out of device memory (to host memory) by filling the free pages and
    evicting."""
    cache = eng.cache
    assert cache is not None
    ids = cache.alloc_device(cache.tiers.device.num_free)
    cache.tiers.evict_device(device_pages)
    cache.drain()
    cache.free_device(ids or [])


def _engine(model: DecoderLM, store: Path, n_tokens: int) -> tuple[Built, int]:
    device_pages = n_tokens // PAGE + 4
    cfg = CacheConfig(
        page_size=PAGE,
        device_pages=device_pages,
        host_pages=2 * device_pages,
        storage_url=f"file://{store}",
        prefetch_policy="wait_complete",  # measure a full storage hit, not a partial one
    )
    return build_engine(EngineConfig(), cfg, model=model), device_pages


def _case(reqs: list[Request], tier: str) -> dict[str, Any]:
    return {
        "ttft_s": statistics.median(r.ttft_s for r in reqs),
        "hit_pages": min(r.hits[tier] for r in reqs),
        "first_tokens": [r.output[0] for r in reqs],
    }


def measure(model: DecoderLM, n_tokens: int, repeats: int, store: Path) -> dict[str, Any]:
    rng = random.Random(0)
    tokens = [rng.randrange(100, model.vocab_size) for _ in range(n_tokens)]
    built, device_pages = _engine(model, store, n_tokens)
    try:
        cold = _serve(built.engine, tokens, "cold")
        device = [_serve(built.engine, tokens, f"device-{i}") for i in range(repeats)]
        host = []
        for i in range(repeats):
            _demote(built.engine, device_pages)
            host.append(_serve(built.engine, tokens, f"host-{i}"))
    finally:
        built.close()
    storage = []
    for i in range(repeats):  # a fresh engine each time: its device and host memory start empty
        fresh, _ = _engine(model, store, n_tokens)
        try:
            storage.append(_serve(fresh.engine, tokens, f"storage-{i}"))
        finally:
            fresh.close()
    cases = {
        "device": _case(device, "device"),
        "host": _case(host, "host"),
        "storage": _case(storage, "storage"),
    }
    report: dict[str, Any] = {
        "prompt_tokens": n_tokens,
        "page_size": PAGE,
        "cached_pages": (n_tokens - 1) // PAGE,
        "cold_ttft_s": cold.ttft_s,
    }
    for name, case in cases.items():
        report[f"{name}_ttft_s"] = case["ttft_s"]
        report[f"{name}_ratio"] = case["ttft_s"] / cold.ttft_s
        report[f"{name}_hit_pages"] = case["hit_pages"]
    report["first_tokens_identical"] = all(
        t == cold.output[0] for c in cases.values() for t in c["first_tokens"]
    )
    report.update({f"{k}_goal": v for k, v in GOALS.items()})
    report["goals_met"] = all(report[k] <= v for k, v in GOALS.items())
    return report


@BENCHES.register("ttft")
def bench_ttft(quick: bool) -> dict[str, Any]:
    """SmolLM2-135M-Instruct; 4k-token prompt (quick: 2k, fewer repeats)."""
    model = load_model(resolve_model_path(EngineConfig()))
    with tempfile.TemporaryDirectory(prefix="kvstrata-ttft-") as tmp:
        return measure(model, 2048 if quick else 4096, 1 if quick else 3, Path(tmp) / "store")

"""The registry of `kvstrata bench NAME` benchmarks.

A benchmark is a function `(quick: bool) -> dict` returning a JSON-ready report whose top-level
numbers are printed as a table; it lives in its own module under kvstrata/bench/ and registers
itself with `@BENCHES.register("name")`. `BENCH_MODULES` lists the modules to import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvstrata.registry import Registry

BenchFn = Callable[[bool], dict[str, Any]]
BENCHES: Registry[dict[str, Any]] = Registry("benchmark")

BENCH_MODULES: tuple[str, ...] = (
    "kvstrata.bench.radix",
    "kvstrata.bench.transfer",
    "kvstrata.bench.storage",
    "kvstrata.bench.consensus",
    "kvstrata.bench.ttft",
    "kvstrata.bench.admission",
    "kvstrata.bench.serve_bench",
    "kvstrata.bench.agent",
    "kvstrata.bench.parallel",
    "kvstrata.bench.spec",
    "kvstrata.bench.prefill",
    "kvstrata.bench.decode",
    "kvstrata.bench.mla",
    "kvstrata.bench.pd",
    "kvstrata.bench.fleet_bench",
    "kvstrata.bench.sglang_hicache",
    "kvstrata.bench.vllm_bench",
    "kvstrata.bench.vllm_copies",
    "kvstrata.bench.replay_flood",
)


def load_benches() -> Registry[dict[str, Any]]:
    """Import every benchmark module so its registration runs."""
    for mod in BENCH_MODULES:
        importlib.import_module(mod)
    return BENCHES

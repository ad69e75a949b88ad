"""kvstrata's counters in vLLM's connector stats and its Prometheus /metrics.

Both sides report increments since their last report under flat names (the scheduler side:
tokens vLLM took from each of kvstrata's tiers; the workers: bytes each kind of move carried);
vLLM sums them over workers (`aggregate`) and hands them to KvstrataPromMetrics, which adds them
to counters `vllm:kvstrata_hit_tokens{tier}`, `vllm:kvstrata_moved_bytes{kind}` and
`vllm:kvstrata_layer_calls{call}` (layer-by-layer copies only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

HIT_PREFIX, BYTES_PREFIX, LAYER_PREFIX = "hit_tokens_", "moved_bytes_", "layer_calls_"
TIERS = ("host", "storage")
MOVES = ("load", "store", "backup", "prefetch")
LAYER_CALLS = ("wait", "save")
"""Layer-by-layer copies: layers whose loads vLLM awaited / whose stores vLLM started."""


@dataclass
class KvstrataStats(KVConnectorStats):
    """Counter increments by name (HIT_PREFIX + tier, BYTES_PREFIX + kind)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvstrataStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvstrataPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of kvstrata's per-tier hits and moved bytes, per vLLM engine."""

    def __init__(
        self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine: Any
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        hits = self._counter_cls(
            name="vllm:kvstrata_hit_tokens",
            documentation="Prompt tokens vLLM took from kvstrata's tiers, by tier",
            labelnames=[*labelnames, "tier"],
        )
        moved = self._counter_cls(
            name="vllm:kvstrata_moved_bytes",
            documentation="KV bytes kvstrata moved, by kind (load, store, backup, prefetch)",
            labelnames=[*labelnames, "kind"],
        )
        layer_calls = self._counter_cls(
            name="vllm:kvstrata_layer_calls",
            documentation="Layer-by-layer copies: layers whose loads vLLM awaited (wait) or "
            "whose stores it started (save), counted when there was a copy",
            labelnames=[*labelnames, "call"],
        )
        self.children: dict[str, dict[int, Any]] = {}
        for tier in TIERS:
            per = {i: [*v, tier] for i, v in per_engine.items()}
            self.children[HIT_PREFIX + tier] = create_metric_per_engine(hits, per)
        for kind in MOVES:
            per = {i: [*v, kind] for i, v in per_engine.items()}
            self.children[BYTES_PREFIX + kind] = create_metric_per_engine(moved, per)
        for call in LAYER_CALLS:
            per = {i: [*v, call] for i, v in per_engine.items()}
            self.children[LAYER_PREFIX + call] = create_metric_per_engine(layer_calls, per)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            child = self.children.get(name, {}).get(engine_idx)
            if child is not None and value:
                child.inc(value)

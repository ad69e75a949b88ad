"""KvstrataConnector: the class vLLM loads by module path (`kv_connector_module_path`).

It only routes vLLM's calls: the scheduler role to VllmKVManager (kvstrata's cache manager),
the worker role to WorkerSide (host pool, storage, copies). Jobs go down in StepMeta; each op's
pages-moved count comes back in StepResults, which vLLM aggregates over the tensor-parallel
workers with `aggregate` (the minimum: an op counts only as far as every worker got).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstrata.cache.events import block_hash
from kvstrata.integrations.vllm.config import VllmConnectorConfig
from kvstrata.integrations.vllm.kv_manager import VllmKVManager
from kvstrata.integrations.vllm.metadata import StepJobs
from kvstrata.integrations.vllm.spec import kv_spec
from kvstrata.integrations.vllm.stats import (
    BYTES_PREFIX,
    HIT_PREFIX,
    LAYER_PREFIX,
    KvstrataPromMetrics,
    KvstrataStats,
)
from kvstrata.integrations.vllm.tier_events import TierChange
from kvstrata.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


_HIT_SOURCE = {"host": CacheHitSource.HOST, "storage": CacheHitSource.DISK}


@dataclass
class StepMeta(KVConnectorMetadata):
    """Scheduler -> workers: this step's jobs."""

    jobs: StepJobs = field(default_factory=StepJobs)


@dataclass
class StepResults(KVConnectorWorkerMetadata):
    """Workers -> scheduler: pages moved per op id."""

    moved: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StepResults:
        assert isinstance(other, StepResults)
        keys = self.moved.keys() | other.moved.keys()
        return StepResults({k: min(self.moved.get(k, 0), other.moved.get(k, 0)) for k in keys})


class KvstrataConnector(KVConnectorBase_V1):
    """vLLM's KV connector API over kvstrata's host pages and storage."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-by-layer copies wait and save between layers: not inside a CUDA graph."""
        return VllmConnectorConfig.from_extra(extra_config).copy_mode != "step"

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        config = VllmConnectorConfig.from_extra(extra)
        spec = kv_spec(vllm_config, config)
        self.kv_manager: VllmKVManager | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            events = vllm_config.kv_events_config
            self.kv_manager = VllmKVManager(
                config, spec, kv_events=events is not None and events.enable_kv_cache_events
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker_side = WorkerSide(config, spec, get_tensor_model_parallel_rank())

    # ---- stats (either role) ------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KvstrataStats | None:
        if self.kv_manager is not None:
            data = {HIT_PREFIX + t: n for t, n in self.kv_manager.take_hit_tokens().items()}
        else:
            moved = self._worker().take_moved_bytes().items()
            data = {BYTES_PREFIX + k: n for k, n in moved}
            data.update({LAYER_PREFIX + k: n for k, n in self._worker().take_layer_calls().items()})
        stats = KvstrataStats(data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvstrataStats:
        return KvstrataStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvstrataPromMetrics:
        return KvstrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker role --------------------------------------------------------------------------
    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker call on the scheduler's connector"
        return self.worker_side

    def _jobs(self) -> StepJobs:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMeta), type(meta)
        return meta.jobs

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().before_forward(self._jobs())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # layer-by-layer copies: this layer's loads (all-at-once copies: done in start_load_kv)
        self._worker().wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # layer-by-layer copies: this layer's stores start (all-at-once: in wait_for_save)
        self._worker().save_layer(layer_name, self._jobs())

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker().after_forward(self._jobs())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Requests whose blocks vLLM kept (request_finished said delay_free) once the stores
        that read them ran: this step's, after wait_for_save (or the next step's get_finished,
        where vLLM asks before saving)."""
        return self._worker().take_finished_sending() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def build_connector_worker_meta(self) -> StepResults | None:
        moved = self._worker().take_results()
        return StepResults(moved) if moved else None

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.kv_manager is not None:
            self.kv_manager.close()

    # ---- scheduler role -----------------------------------------------------------------------
    def _kv(self) -> VllmKVManager:
        assert self.kv_manager is not None, "a scheduler call on a worker's connector"
        return self.kv_manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._kv().num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """vLLM's per-source hit counter: host pages as HOST, storage as DISK."""
        split = self._kv().hit_sources(request.request_id)
        if sum(split.values()) != num_external_tokens:
            return {}  # not admitted as planned: vLLM counts it as external_unspecified
        return {_HIT_SOURCE[tier]: n for tier, n in split.items()}

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()[0]
        self._kv().update_state_after_alloc(request, list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return StepMeta(self._kv().build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        results = connector_output.kv_connector_worker_meta
        if isinstance(results, StepResults):
            self._kv().report(results.moved)

    def take_events(self) -> Iterable[KVCacheEvent]:
        page = self._kv().page
        return [vllm_event(c, page) for c in self._kv().take_tier_changes()]

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """delay_free while a store of an evicted page still reads the request's blocks (the
        write policy copies on eviction, e.g. write_back): freed once get_finished reports it."""
        return self._kv().request_finished(request), None


def vllm_event(tc: TierChange, page_size: int) -> KVCacheEvent:
    """One run of host ("CPU") or storage ("DISK") pages as vLLM's KV event (a block = a page)."""
    c = tc.change
    hashes = [block_hash(k) for k in c.keys]
    if not c.stored:
        return BlockRemoved(block_hashes=hashes, medium=c.medium, group_idx=0)
    extra = [(s,) if s else None for s in tc.salts]  # each page's cache_salt, untagged
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if c.parent is None else block_hash(c.parent),
        token_ids=tc.tokens,
        block_size=page_size,
        lora_id=None,
        medium=c.medium,
        lora_name=None,
        extra_keys=extra or None,
        group_idx=0,
    )

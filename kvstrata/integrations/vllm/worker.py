"""The connector's worker side: moves page bytes between vLLM's paged KV and the host pool.

Each vLLM worker holds a host pool of its own KV heads (the same page ids on every worker,
decided by the scheduler side) and opens the store as topology-free units of its heads
(kvstrata.storage.units), so a page stored at one tensor-parallel size is read at another.
A step runs its jobs in order: storage jobs and host -> vLLM loads before the forward, vLLM -> host
stores after it (they read blocks this forward writes). Copies run all layers at once on vLLM's
thread, or layer by layer on a copy thread (LayerMoves; config `copy_mode`): then a layer's loads
are awaited just before that layer computes and its stores start right after it. Each op's pages-moved count goes back to
the scheduler side; storage trouble is a short count (a miss), never an exception.
"""

from __future__ import annotations

import logging

import torch

from kvstrata.cache.ops import BACKUP, PREFETCH, PROBE
from kvstrata.integrations.vllm.blocks import BlockLayout
from kvstrata.integrations.vllm.config import VllmConnectorConfig
from kvstrata.integrations.vllm.layer_moves import LayerMoves
from kvstrata.integrations.vllm.metadata import CopyJob, StepJobs, StorageJob
from kvstrata.integrations.vllm.spec import KVSpec
from kvstrata.memory.pool import HostPool
from kvstrata.storage.base import StorageBackend, StorageConfig, put_report
from kvstrata.storage.units import PagePart, open_unit_storage

log = logging.getLogger(__name__)


class WorkerSide:
    """One vLLM worker's host pool, storage view and copies (see module doc)."""

    def __init__(self, config: VllmConnectorConfig, spec: KVSpec, tp_rank: int) -> None:
        self.spec = spec
        # pinned whenever CUDA is available (HostPool's rule): the CUDA block copier needs it
        self.host = HostPool(spec.local_shape, config.host_pool_pages(spec.page_nbytes))
        self.storage: StorageBackend | None = None
        if config.storage_url:
            part = PagePart(spec.full_shape, (0, spec.num_layers), spec.heads_of(tp_rank))
            # markers: the scheduler side commits once every worker wrote its units (JobMover)
            self.storage = open_unit_storage(
                config.storage_url, part, StorageConfig(), commit_on_put=False, layout=spec.units
            )
        self.blocks: BlockLayout | None = None
        self.config = config
        self.layers: LayerMoves | None = None  # set when copies run layer by layer
        self.check_each_step = config.check_integrity
        self.results: dict[int, int] = {}
        self.load_errors: set[int] = set()
        self.finished_sending: set[str] = set()  # requests whose last stores ran: blocks free
        self.moved_bytes = {"load": 0, "store": 0, "backup": 0, "prefetch": 0}

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.blocks = BlockLayout.of(list(kv_caches.values()), self.spec)
        stacked = self.blocks.stacked is not None
        how = "one copy per run of blocks, all layers" if stacked else "per layer"
        if self.config.layer_copies(self.blocks.device.type):
            self.layers = LayerMoves(
                self.blocks, self.host, list(kv_caches), self.config.copy_timeout_s
            )
            how += ", layer by layer on a copy thread"
        log.info("kvstrata: vLLM KV layout %s, page copies %s", self.blocks.name, how)

    # ---- a step -------------------------------------------------------------------------------
    def before_forward(self, jobs: StepJobs) -> None:
        self.load_errors.update(jobs.failed_blocks)
        for sjob in jobs.storage:
            self.results[sjob.op_id] = self._storage(sjob)
        if self.layers is not None:
            self.layers.start_loads(jobs)
            return
        for job in jobs.loads:
            self.results[job.op_id] = self._copy(job, to_vllm=True)

    def wait_layer(self, layer_name: str) -> None:
        """Before vLLM computes `layer_name`: its loads are in place (layer-by-layer copies)."""
        if self.layers is not None:
            self.layers.wait_layer(layer_name)

    def save_layer(self, layer_name: str, jobs: StepJobs) -> None:
        """After vLLM computed `layer_name`: start copying out its stored blocks."""
        if self.layers is not None:
            self.layers.save_layer(layer_name, jobs)

    def after_forward(self, jobs: StepJobs) -> None:
        if self.layers is not None:
            self.results.update(self.layers.finish(jobs))
            for job in jobs.loads:
                self._count(job, to_vllm=True)
            for job in jobs.stores:
                self._count(job, to_vllm=False)
        else:
            for job in jobs.stores:
                self.results[job.op_id] = self._copy(job, to_vllm=False)
        self.finished_sending.update(jobs.finished_sending)  # the stores that read them ran
        if self.check_each_step:
            self.check_integrity()

    def take_moved_bytes(self) -> dict[str, int]:
        out = self.moved_bytes
        self.moved_bytes = dict.fromkeys(out, 0)
        return out

    def take_layer_calls(self) -> dict[str, int]:
        """Layers whose loads vLLM awaited / whose stores it started since the last take."""
        return self.layers.take_calls() if self.layers is not None else {}

    def take_finished_sending(self) -> set[str]:
        """Finished requests whose blocks no store reads any more (vLLM frees them)."""
        out, self.finished_sending = self.finished_sending, set()
        return out

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def take_results(self) -> dict[int, int]:
        out, self.results = self.results, {}
        return out

    # ---- moves --------------------------------------------------------------------------------
    def _copy(self, job: CopyJob, to_vllm: bool) -> int:
        assert self.blocks is not None, "vLLM did not register its KV caches"
        self.blocks.copy(self.host, job.pages, to_vllm)
        return self._count(job, to_vllm)

    def _count(self, job: CopyJob, to_vllm: bool) -> int:
        kind = "load" if to_vllm else "store"
        self.moved_bytes[kind] += len(job.pages) * self.spec.page_nbytes
        return len(job.pages)

    def _storage(self, job: StorageJob) -> int:
        if self.storage is None:
            return 0
        try:
            if job.kind == PROBE:
                return self.storage.exists_prefix(list(job.keys))
            pages = [self.host.page_bytes(h) for h in job.host_ids]
            if job.kind == BACKUP:  # all or nothing: only a whole backup is committed
                report = put_report(self.storage, list(job.keys), pages)
                done = report.stored if report.stored == len(job.keys) else 0
                self.moved_bytes[job.kind] += report.written_bytes  # pages kept: not moved
                return done
            else:
                assert job.kind == PREFETCH, job.kind
                done = self.storage.get(list(job.keys), pages)
        except Exception as exc:  # noqa: BLE001 - unreachable or broken storage is a miss
            log.warning("kvstrata: storage %s of %d pages failed: %s", job.kind, len(job.keys), exc)
            return 0
        self.moved_bytes[job.kind] += done * self.spec.page_nbytes
        return done

    def check_integrity(self) -> None:
        self.host.check_integrity()
        if self.storage is not None:
            self.storage.check_integrity()

    def close(self) -> None:
        if self.layers is not None:
            self.layers.close()
        if self.storage is not None:
            self.storage.close()

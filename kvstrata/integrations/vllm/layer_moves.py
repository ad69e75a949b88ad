"""One vLLM step's host <-> vLLM copies, layer by layer, through kvstrata's CopyQueue.

vLLM's calls, in a step's order:
    start_load_kv        -> start_loads: one load op over every layer (copied in layer order)
    per attention layer  -> wait_layer (before it: its loaded blocks are in place; CUDA: the
                            compute stream waits on the layer's event) and save_layer (after it:
                            one store op of that layer's written blocks)
    wait_for_save        -> finish: every op done (a layer vLLM never saved is stored here), the
                            pages-moved count of each job
vLLM calls start_load_kv *after* the forward in steps without loads, so a step's stores are taken
from its jobs at whichever call comes first (`_begin`, once per StepJobs).
Every wait is bounded (`timeout_s`); a late layer raises naming the layer and the requests.
A copy error raises too: a failing local copy is a bug, never a silent miss.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import numpy as np

from kvstrata.integrations.vllm.block_copiers import block_copier
from kvstrata.integrations.vllm.blocks import BlockLayout, block_triples
from kvstrata.integrations.vllm.metadata import CopyJob, StepJobs
from kvstrata.memory.copy_engine import CopyQueue
from kvstrata.memory.handle import TransferHandle
from kvstrata.memory.pool import HostPool

log = logging.getLogger(__name__)


class LayerMoves:
    """The worker's layer-by-layer copies (see module doc); one step at a time."""

    def __init__(
        self, layout: BlockLayout, host: HostPool, layer_names: Sequence[str], timeout_s: float
    ) -> None:
        self.layout, self.timeout_s = layout, timeout_s
        self.names = list(layer_names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.ratio = layout.spec.page_size // layout.spec.block_size
        self.queue = CopyQueue(
            block_copier(layout, host), len(layer_names), layout.layer_block_nbytes, layout.device
        )
        self._load: TransferHandle | None = None
        self._load_jobs: list[CopyJob] = []
        self._step: StepJobs | None = None  # the jobs of the step in progress
        self._store_slots: tuple[np.ndarray, np.ndarray] = self._slots([])
        self._saved: dict[int, TransferHandle] = {}  # layer -> its store op this step
        self._awaited: set[int] = set()  # layers whose loads vLLM waited for this step
        self._warned: set[str] = set()
        self.calls = {"wait": 0, "save": 0}  # layers awaited / saved with a copy, since taken

    def _slots(self, jobs: Sequence[CopyJob]) -> tuple[np.ndarray, np.ndarray]:
        """(host block slots, vLLM blocks) of every copied block of these jobs."""
        triples = block_triples([p for job in jobs for p in job.pages])
        host = np.array([h * self.ratio + j for h, j, _ in triples], dtype=np.int64)
        return host, np.array([blk for _, _, blk in triples], dtype=np.int64)

    def _begin(self, jobs: StepJobs) -> None:
        """First call of a step: take its stores (copied as vLLM saves each layer)."""
        if self._step is not jobs:
            if self._step is not None:  # vLLM skipped wait_for_save (a failed forward)
                log.warning("kvstrata: a step's copies were not finished; finishing them now")
                self.finish(self._step)
            self._step, self._saved = jobs, {}
            self._store_slots = self._slots(jobs.stores)

    def start_loads(self, jobs: StepJobs) -> None:
        """Queue this step's loads as one op over every layer; returns at once."""
        self._begin(jobs)
        self._load_jobs = list(jobs.loads)
        host, vllm = self._slots(jobs.loads)
        self._load = None
        if host.size:
            self._load = self.queue.submit("load", host, vllm, dst_name="vLLM blocks")

    def wait_layer(self, layer_name: str) -> None:
        """Layer `layer_name`'s loaded blocks are in place (CUDA: for the current stream)."""
        if self._load is not None:
            layer = self._layer(layer_name)
            self._bounded(self._load, layer_name, self._load_jobs, layer)
            self._awaited.add(layer)
            self.calls["wait"] += 1

    def save_layer(self, layer_name: str, jobs: StepJobs) -> None:
        """Queue the copy-out of `layer_name`'s stored blocks (written by this forward)."""
        self._begin(jobs)
        if self._store_slots[0].size:
            layer = self._layer(layer_name)
            self._saved[layer] = self._submit_store(range(layer, layer + 1))
            self.calls["save"] += 1

    def _submit_store(self, layers: range) -> TransferHandle:
        host, vllm = self._store_slots
        return self.queue.submit("store", vllm, host, layers, dst_name="host blocks")

    def finish(self, jobs: StepJobs) -> dict[int, int]:
        """Wait for every op of the step (bounded); pages moved per job op id."""
        self._begin(jobs)
        moved: dict[int, int] = {}
        if self._load is not None:
            self._bounded(self._load, "every layer", self._load_jobs)
            self._warn_once("waited for no load of layers", self._awaited)
        moved.update({job.op_id: len(job.pages) for job in self._load_jobs})
        if self._store_slots[0].size:
            for layer in self._warn_once("saved no KV of layers", self._saved):
                self._saved[layer] = self._submit_store(range(layer, layer + 1))
            for layer, handle in sorted(self._saved.items()):
                self._bounded(handle, self.names[layer], jobs.stores)
        moved.update({job.op_id: len(job.pages) for job in jobs.stores})
        self._load, self._load_jobs, self._step, self._awaited = None, [], None, set()
        return moved

    def _warn_once(self, what: str, seen: Collection[int]) -> list[int]:
        """Layers vLLM skipped (`seen` lacks them), logged once per kind: a skipped save is
        stored here, after the forward; a skipped load wait may have raced the forward."""
        missing = [i for i in range(len(self.names)) if i not in seen]
        if missing and what not in self._warned:
            self._warned.add(what)
            log.warning("kvstrata: vLLM %s %s in a step", what, missing)
        return missing

    def _layer(self, layer_name: str) -> int:
        try:
            return self.index[layer_name]
        except KeyError:
            raise ValueError(
                f"kvstrata: vLLM named KV layer {layer_name!r}, not registered"
            ) from None

    def _bounded(
        self, handle: TransferHandle, what: str, jobs: Sequence[CopyJob], layer: int | None = None
    ) -> None:
        try:
            if layer is None:
                handle.wait(self.timeout_s)
            else:
                handle.wait_layer(layer, self.timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"kvstrata: {handle.kind} of layer {what} for requests {_requests(jobs)} not "
                f"done after {self.timeout_s} s"
            ) from None
        except RuntimeError as exc:  # the copy itself failed
            raise RuntimeError(
                f"kvstrata: {handle.kind} of layer {what} for requests {_requests(jobs)} failed"
            ) from exc

    def take_calls(self) -> dict[str, int]:
        out, self.calls = self.calls, dict.fromkeys(self.calls, 0)
        return out

    def close(self) -> None:
        self.queue.close()


def _requests(jobs: Sequence[CopyJob]) -> list[str]:
    return sorted({r for job in jobs for r in job.requests})

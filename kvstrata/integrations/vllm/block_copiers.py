"""Copiers between the host pool and vLLM's paged blocks, chosen by the device vLLM's KV lives on.

They plug into kvstrata's CopyQueue (kvstrata.memory.copy_engine), which runs ops in order on one
thread and completes each op's TransferHandle layer by layer. An op's slots are block slots:
host side `host_id * r + j` (block j of host page host_id, r blocks a page), vLLM side the vLLM
block id; loads go host -> vLLM, stores vLLM -> host.

    cpu   torch copies on the copy thread; a layer is done once its bytes are in place
    cuda  non_blocking copies on a dedicated stream that first waits for the submitter's stream
          (a saved layer's writes are final), one torch.cuda.Event per layer recorded after its
          copies: a waiter's stream waits on that event, the host does not block. Needs a pinned
          host pool. Not run on a GPU yet (this machine has none).
"""

from __future__ import annotations

import numpy as np
import torch

from kvstrata.integrations.vllm.blocks import BlockLayout, Triple
from kvstrata.memory.copy_engine import (
    CopyOp,
    LayerDone,
    PageCopier,
    Runs,
    layer_groups,
    serial_layers,
)
from kvstrata.memory.handle import TransferHandle
from kvstrata.memory.pool import HostPool
from kvstrata.registry import Registry

BLOCK_COPIERS: Registry[PageCopier] = Registry("device of vLLM's KV cache")


def op_triples(op: CopyOp, ratio: int) -> list[Triple]:
    """The op's (host page, block in page, vLLM block) triples from its block slots."""
    host, vllm = (op.src, op.dst) if op.handle.kind == "load" else (op.dst, op.src)
    pages, offsets = np.divmod(host, ratio)
    return list(zip(pages.tolist(), offsets.tolist(), vllm.tolist(), strict=True))


class _BlockCopier:
    """Shared part: the layout, the host view and one copy call per layer of an op."""

    cuda = False
    non_blocking = False

    def __init__(self, layout: BlockLayout, host: HostPool) -> None:
        self.layout = layout
        self.host_view = layout.host_view(host)
        self.ratio = layout.spec.page_size // layout.spec.block_size

    def copy_op(self, op: CopyOp, done: LayerDone) -> None:
        triples, first = op_triples(op, self.ratio), op.first_layer
        to_vllm = op.handle.kind == "load"

        def copy(kind: str, layers: range, runs: Runs) -> None:
            model_layers = range(first + layers.start, first + layers.stop)
            self.layout.copy_blocks(
                self.host_view, triples, model_layers, to_vllm, self.non_blocking
            )

        serial_layers(copy, op.handle.kind, layer_groups(op.handle.num_layers, 1), [], done)

    def close(self) -> None:
        pass


@BLOCK_COPIERS.register("cpu")
class CpuBlockCopier(_BlockCopier):
    """Copies on the queue's thread; a layer is complete once its bytes are copied."""

    def run(self, op: CopyOp, runs: Runs, done: LayerDone) -> None:
        self.copy_op(op, done)

    def mark(self, handle: TransferHandle, layer: int) -> None:
        handle.complete_layer(layer)


@BLOCK_COPIERS.register("cuda")
class CudaBlockCopier(_BlockCopier):
    """Enqueues each layer's copies on a dedicated stream and records that layer's event."""

    cuda = True
    non_blocking = True

    def __init__(self, layout: BlockLayout, host: HostPool) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"kvstrata: vLLM's KV cache is on {layout.device}, but torch.cuda is not "
                "available here: the CUDA block copier cannot run"
            )
        if not host.pinned:
            raise ValueError("kvstrata: the host pool must be pinned for vLLM's KV on CUDA")
        super().__init__(layout, host)
        self.stream = torch.cuda.Stream(device=layout.device)

    def run(self, op: CopyOp, runs: Runs, done: LayerDone) -> None:
        self.stream.wait_event(op.ready)  # blocks a save reads are written by then
        with torch.cuda.stream(self.stream):
            self.copy_op(op, done)

    def mark(self, handle: TransferHandle, layer: int) -> None:
        handle.complete_layer(layer, self.stream)


def block_copier(layout: BlockLayout, host: HostPool) -> PageCopier:
    """The copier for the device vLLM's KV is on; an unknown device is refused by name."""
    return BLOCK_COPIERS.create(layout.device.type, layout, host)

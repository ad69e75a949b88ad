"""`kvstrata bench vllm_copies`: the vLLM connector's host <-> vLLM copies of one step, all layers at
once (copy_mode "step") against layer by layer on the copy thread ("layer"), in one run.

No vLLM here: SmolLM2-135M's KV geometry (30 layers, 3 KV heads of 64, fp32, block 32) in vLLM's
CPU layout (every layer in one buffer), a step that loads `pages` host pages into vLLM blocks,
runs 30 layers of stand-in compute (a matmul per layer, one torch thread, as vLLM's CPU worker)
and stores `stored` pages, with vLLM blocks scattered or consecutive (a run of consecutive blocks
is one copy). The modes alternate rep by rep; "copies only" runs no compute (the copies' own
cost), "with compute" is what overlap can win back.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvstrata.bench.registry import BENCHES
from kvstrata.integrations.vllm.blocks import BlockLayout
from kvstrata.integrations.vllm.layer_moves import LayerMoves
from kvstrata.integrations.vllm.metadata import BlockCopy, CopyJob, StepJobs
from kvstrata.integrations.vllm.spec import KVSpec
from kvstrata.memory.pool import HostPool

SPEC = KVSpec(32, 32, 30, 3, 1, 64, "float32", "bench-vllm-copies")
BLOCKS = 256  # vLLM blocks


def _one_buffer_layers() -> list[torch.Tensor]:
    """Every layer a view of one buffer, [blocks, heads, block, 2*dim] each (vLLM's CPU layout)."""
    s = SPEC
    per = BLOCKS * s.local_heads * s.block_size * 2 * s.head_dim
    buf = torch.randn(s.num_layers * per)
    shape = (BLOCKS, s.local_heads, s.block_size, 2 * s.head_dim)
    return [buf[i * per : (i + 1) * per].view(shape) for i in range(s.num_layers)]


class _Step:
    """One simulated vLLM step over real layer tensors and a real host pool."""

    def __init__(self, pages: int, stored: int, compute_reps: int, stride: int) -> None:
        s = SPEC
        self.layout = BlockLayout.of(_one_buffer_layers(), s)
        self.host = HostPool(s.local_shape, 2 * (pages + stored), pin_memory=False)
        self.host.data.normal_()
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(s.num_layers)]
        self.moves = LayerMoves(self.layout, self.host, self.names, timeout_s=60)
        # vLLM blocks `stride` apart: 1 = consecutive (one copy per run), 3 = scattered
        loads = tuple(BlockCopy(i, (stride * i + 1,)) for i in range(pages))
        stores = tuple(BlockCopy(pages + i, (stride * (pages + i) + 1,)) for i in range(stored))
        self.loads, self.stores = loads, stores
        self.x, self.w = torch.randn(64, 576), torch.randn(576, 1536)  # ~ a layer's MLP, 64 tokens
        self.reps = compute_reps

    def jobs(self) -> StepJobs:
        return StepJobs(loads=[CopyJob(1, self.loads)], stores=[CopyJob(2, self.stores)])

    def _compute(self) -> None:
        for _ in range(self.reps):
            (self.x @ self.w).relu_()

    def step_mode(self) -> None:
        jobs = self.jobs()
        self.layout.copy(self.host, jobs.loads[0].pages, to_vllm=True)
        for _ in self.names:
            self._compute()
        self.layout.copy(self.host, jobs.stores[0].pages, to_vllm=False)

    def layer_mode(self) -> None:
        jobs = self.jobs()
        self.moves.start_loads(jobs)
        for name in self.names:
            self.moves.wait_layer(name)
            self._compute()
            self.moves.save_layer(name, jobs)
        self.moves.finish(jobs)


def _median_ms(runs: list[float]) -> float:
    return statistics.median(runs) * 1e3


def _pair(step: _Step, reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"step": [], "layer": []}
    modes: dict[str, Callable[[], None]] = {"step": step.step_mode, "layer": step.layer_mode}
    for _ in range(reps):
        for name, run in modes.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return {name: _median_ms(v) for name, v in times.items()}


@BENCHES.register("vllm_copies")
def vllm_copies_bench(quick: bool) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pages, stored, reps = (6, 2, 5) if quick else (12, 6, 30)
    out: dict[str, Any] = {"pages_loaded": pages, "pages_stored": stored}
    try:
        for blocks, stride in (("scattered", 3), ("consecutive", 1)):
            bare, busy = _Step(pages, stored, 0, stride), _Step(pages, stored, 3, stride)
            copies, compute = _pair(bare, reps), _pair(busy, reps)
            bare.moves.close()
            busy.moves.close()
            out |= {
                f"copies_only_ms_step_{blocks}": copies["step"],
                f"copies_only_ms_layer_{blocks}": copies["layer"],
                f"copies_only_ratio_layer_vs_step_{blocks}": copies["layer"] / copies["step"],
                f"with_compute_ms_step_{blocks}": compute["step"],
                f"with_compute_ms_layer_{blocks}": compute["layer"],
                f"with_compute_ratio_layer_vs_step_{blocks}": compute["layer"] / compute["step"],
            }
    finally:
        torch.set_num_threads(threads)
    return out | {"load_average_1m": os.getloadavg()[0]}

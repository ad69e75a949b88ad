"""Layer-by-layer copies between kvstrata's host pool and vLLM's paged KV (CPU attention layout),
through kvstrata's CopyQueue: each layer is usable once its wait returns, saves copy out exactly
the saved layer, a late layer's wait is bounded and names the layer and the request, and the
copier is chosen by the device vLLM's KV is on."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstrata.integrations.vllm.block_copiers import (
    BLOCK_COPIERS,
    CpuBlockCopier,
    CudaBlockCopier,
    block_copier,
)
from kvstrata.integrations.vllm.blocks import BlockLayout
from kvstrata.integrations.vllm.layer_moves import LayerMoves
from kvstrata.integrations.vllm.metadata import BlockCopy, CopyJob, StepJobs
from kvstrata.memory.pool import HostPool
from tests.test_vllm_blocks import PAGES, SPEC, N, block_of, host_pool, one_buffer, separate

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(SPEC.num_layers)]


def loaded_right(layout: BlockLayout, host: HostPool, layer: int) -> bool:
    """Every block PAGES names holds its host bytes in `layer`."""
    view = layout.views[layer]
    return all(
        torch.equal(block_of(view, blk), host.data[p.host_id, layer, :, j * 4 : (j + 1) * 4])
        for p in PAGES
        for j, blk in enumerate(p.blocks)
        if blk >= 0
    )


@pytest.mark.parametrize("layers", [one_buffer, separate])
def test_loads_then_saves_layer_by_layer_move_exact_bytes(
    layers, caplog: pytest.LogCaptureFixture
) -> None:
    host = host_pool()
    layout = BlockLayout.of(layers(), SPEC)
    moves = LayerMoves(layout, host, NAMES, timeout_s=30)
    try:
        step = StepJobs(loads=[CopyJob(7, PAGES, ("req-a",))])
        moves.start_loads(step)
        for layer, name in enumerate(NAMES):
            moves.wait_layer(name)
            assert loaded_right(layout, host, layer)
            moves.save_layer(name, step)  # no stores this step: nothing queued
        assert moves.finish(step) == {7: 2}
        assert moves.take_calls() == {"wait": 3, "save": 0}
        untouched = {0, 2, 4}
        assert all(
            float(v.reshape(N, -1)[b].abs().sum()) == 0 for v in layout.views for b in untouched
        )
        # vLLM -> host: layer 0 saved by vLLM, layers 1-2 never saved: finish stores them
        out = HostPool(SPEC.local_shape, 4)
        back = StepJobs(stores=[CopyJob(8, (BlockCopy(1, (3, 4)), BlockCopy(3, (5, 1))))])
        moves2 = LayerMoves(layout, out, NAMES, timeout_s=30)
        moves2.save_layer(NAMES[0], back)
        assert moves2.finish(back) == {8: 2}
        assert moves2.take_calls() == {"wait": 0, "save": 1}
        moves2.close()
        warned = [r.getMessage() for r in caplog.records]
        assert warned == ["kvstrata: vLLM saved no KV of layers [1, 2] in a step"]
        assert torch.equal(out.data[1, :, :, :4], host.data[0, :, :, :4])
        assert torch.equal(out.data[3], host.data[2])
        assert float(out.data[1, :, :, 4:].abs().sum()) == 0  # block 4 was never written
        out.check_integrity()
    finally:
        moves.close()


def test_a_late_layer_is_a_bounded_wait_naming_the_layer_and_request() -> None:
    host = host_pool()
    layout = BlockLayout.of(one_buffer(), SPEC)
    release = threading.Event()
    real = layout.copy_blocks

    def slow_from_layer_2(host_view, triples, layers, to_vllm, non_blocking=False) -> None:
        if 2 in layers:
            release.wait(10)  # fault injection: layer 2's copy takes long
        real(host_view, triples, layers, to_vllm, non_blocking)

    layout.copy_blocks = slow_from_layer_2  # type: ignore[method-assign]
    moves = LayerMoves(layout, host, NAMES, timeout_s=0.05)
    step = StepJobs(loads=[CopyJob(7, PAGES, ("req-a",))])
    moves.start_loads(step)
    moves.wait_layer(NAMES[0])
    moves.wait_layer(NAMES[1])  # layers 0 and 1 are usable while layer 2 still copies
    assert loaded_right(layout, host, 1) and not loaded_right(layout, host, 2)
    with pytest.raises(
        TimeoutError, match=r"load of layer model\.layers\.2\.self_attn\.attn.*req-a"
    ):
        moves.wait_layer(NAMES[2])
    release.set()
    moves.timeout_s = 30
    assert moves.finish(step) == {7: 2} and loaded_right(layout, host, 2)
    moves.close()


def test_the_copier_is_chosen_by_the_device_of_vllms_kv() -> None:
    host = host_pool()
    layout = BlockLayout.of(one_buffer(), SPEC)
    assert isinstance(block_copier(layout, host), CpuBlockCopier)
    assert BLOCK_COPIERS.names() == ["cpu", "cuda"]
    with pytest.raises(ValueError, match="unknown device of vLLM's KV cache 'xpu'"):
        BLOCK_COPIERS.get("xpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal only where CUDA is missing")
def test_the_cuda_copier_refuses_by_name_without_cuda() -> None:
    layout = BlockLayout.of(one_buffer(), SPEC)
    with pytest.raises(RuntimeError, match="torch.cuda is not available"):
        CudaBlockCopier(layout, host_pool())

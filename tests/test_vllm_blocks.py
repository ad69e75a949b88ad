"""Page copies between kvstrata's host pool and vLLM's paged KV layers (CPU attention layout).

vLLM 0.32 allocates every layer in one buffer at a fixed layer stride: the copies then run over
all layers at once. Layers in separate tensors take the per-layer path. Both must move exactly
the same bytes: host page p's block j (tokens [j*block, (j+1)*block)) <-> vLLM block blocks[j].
"""

from __future__ import annotations

import torch

from kvstrata.integrations.vllm.blocks import BlockLayout, block_runs, block_triples
from kvstrata.integrations.vllm.metadata import BlockCopy
from kvstrata.integrations.vllm.spec import KVSpec
from kvstrata.memory.pool import HostPool

SPEC = KVSpec(4, 8, 3, 2, 1, 8, "float32", "blocks-test")  # block 4, page 8 (2 blocks), 3 layers
N = 6  # vLLM blocks
PAGES = (BlockCopy(0, (3, -1)), BlockCopy(2, (5, 1)))


def one_buffer() -> list[torch.Tensor]:
    """Layers as vLLM allocates them: views of one buffer, [blocks, heads, block, 2*dim] each."""
    s = SPEC
    per = N * s.kv_heads * s.block_size * 2 * s.head_dim
    buf = torch.zeros(s.num_layers * per)
    return [buf[i * per : (i + 1) * per].view(N, s.kv_heads, s.block_size, -1) for i in range(3)]


def separate() -> list[torch.Tensor]:
    return [torch.zeros(N, SPEC.kv_heads, SPEC.block_size, 2 * SPEC.head_dim) for _ in range(3)]


def host_pool() -> HostPool:
    host = HostPool(SPEC.local_shape, 4)
    host.data.copy_(torch.randn(host.data.shape, generator=torch.Generator().manual_seed(0)))
    return host


def block_of(view: torch.Tensor, blk: int) -> torch.Tensor:
    """Block `blk` of a layer's block-first view [blocks, heads, 2, block, dim] as the host's
    [2, block, heads, dim]."""
    return view[blk].permute(1, 2, 0, 3)


def test_all_layers_at_once_moves_the_same_bytes_as_layer_by_layer() -> None:
    host = host_pool()
    fast, slow = BlockLayout.of(one_buffer(), SPEC), BlockLayout.of(separate(), SPEC)
    assert fast.stacked is not None and slow.stacked is None
    for layout in (fast, slow):
        layout.copy(host, PAGES, to_vllm=True)
        for layer, view in enumerate(layout.views):
            for p in PAGES:
                for j, blk in enumerate(p.blocks):
                    if blk >= 0:
                        want = host.data[p.host_id, layer, :, j * 4 : (j + 1) * 4]
                        assert torch.equal(block_of(view, blk), want)
        untouched = {0, 2, 4}  # blocks no page named (-1 skips one)
        assert all(
            float(v.reshape(N, -1)[b].abs().sum()) == 0 for v in layout.views for b in untouched
        )
    # vLLM -> host into fresh slots 1 and 3: the same bytes come back
    back = (BlockCopy(1, (3, 4)), BlockCopy(3, (5, 1)))
    for layout in (fast, slow):
        out = HostPool(SPEC.local_shape, 4)
        layout.copy(out, back, to_vllm=False)
        assert torch.equal(out.data[1, :, :, :4], host.data[0, :, :, :4])
        assert torch.equal(out.data[3], host.data[2])
        assert float(out.data[1, :, :, 4:].abs().sum()) == 0  # block 4 was never written
    host.check_integrity()


def test_runs_of_consecutive_pages_and_blocks_move_the_same_bytes() -> None:
    """Page = block: consecutive host pages onto consecutive vLLM blocks go as one strided copy
    per run; the bytes equal the per-layer path's, both directions."""
    spec = KVSpec(4, 4, 3, 2, 1, 8, "float32", "runs-test")  # block = page = 4 tokens
    # host 0,1,2 -> blocks 1,2,3 (one run), host 3 -> block 5, host 5 -> block 4 (runs of 1)
    pages = tuple(BlockCopy(h, (b,)) for h, b in ((0, 1), (1, 2), (2, 3), (3, 5), (5, 4)))
    assert block_runs(block_triples(pages)) == [(0, 0, 1, 3), (3, 0, 5, 1), (5, 0, 4, 1)]
    per = N * spec.kv_heads * spec.block_size * 2 * spec.head_dim
    buf = torch.zeros(3 * per)
    stacked = [buf[i * per : (i + 1) * per].view(N, 2, 4, -1) for i in range(3)]
    separate = [torch.zeros(N, 2, 4, 2 * spec.head_dim) for _ in range(3)]
    host = HostPool(spec.local_shape, 6)
    host.data.copy_(torch.randn(host.data.shape, generator=torch.Generator().manual_seed(1)))
    fast, slow = BlockLayout.of(stacked, spec), BlockLayout.of(separate, spec)
    assert fast.stacked is not None and slow.stacked is None
    fast.copy(host, pages, to_vllm=True)
    slow.copy(host, pages, to_vllm=True)
    assert all(torch.equal(a, b) for a, b in zip(stacked, separate, strict=True))
    assert float(stacked[0][0].abs().sum()) == 0  # block 0 untouched
    back = HostPool(spec.local_shape, 6)
    fast.copy(back, pages, to_vllm=False)
    for p in pages:
        assert torch.equal(back.data[p.host_id], host.data[p.host_id])
    assert float(back.data[4].abs().sum()) == 0

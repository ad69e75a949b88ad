"""`kvstrata bench mla`: latent attention's decode step, absorbed (latent space) vs plain.

One MLA block with DeepSeek-V3's per-head sizes (kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128; 16 heads here, random seeded weights) decodes one token
for each of B sequences over a C-token context of latent pages, both ways in the same run:
median step time of each and their ratio, their outputs' relative difference, and the bytes one
token's cache costs per layer as latent rows against the per-head K/V the same model would
otherwise store.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from kvstrata.bench.registry import BENCHES
from kvstrata.model.attn_meta import build_meta
from kvstrata.model.mla_attention import MLADims, MLAttention

PAGE = 64
DIMS = MLADims(
    hidden=1024,
    heads=16,
    q_lora_rank=384,
    kv_lora_rank=512,
    nope_dim=128,
    rope_dim=64,
    v_dim=128,
    attention_bias=False,
    rope_interleave=True,
    scaling=192**-0.5,
)


def _step_times(attn: MLAttention, args: tuple[Any, ...], absorb: bool, reps: int) -> list[float]:
    attn.absorb = absorb
    attn(*args)  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        attn(*args)
        times.append(time.perf_counter() - t)
    return times


@torch.inference_mode()
def _case(ctx: int, seqs: int, reps: int) -> dict[str, float]:
    """Plain and absorbed decode steps of `seqs` sequences over `ctx` cached tokens each."""
    torch.manual_seed(0)
    attn = MLAttention(DIMS, torch.float32)
    for p in attn.parameters():
        p.normal_(0.0, 0.02)
    n_pages = -(-ctx // PAGE)
    pool = torch.randn(2, seqs * n_pages, PAGE, 1, DIMS.row // 2)  # latent pages, K/V halves
    tables = [torch.arange(s * n_pages, (s + 1) * n_pages) for s in range(seqs)]
    meta = build_meta(torch.full((seqs,), ctx - 1), [1] * seqs, [ctx] * seqs, tables, PAGE)
    rope = (torch.ones(seqs, DIMS.rope_dim), torch.zeros(seqs, DIMS.rope_dim))
    args = (torch.randn(seqs, DIMS.hidden), *rope, pool[0], pool[1], meta)
    plain = statistics.median(_step_times(attn, args, False, reps))
    absorbed = statistics.median(_step_times(attn, args, True, reps))
    attn.absorb = False
    ref = attn(*args)
    attn.absorb = True
    diff = float((attn(*args) - ref).abs().max() / ref.abs().max())
    return {
        "plain_step_s": plain,
        "absorbed_step_s": absorbed,
        "speedup": plain / absorbed,
        "rel_diff": diff,
    }


@BENCHES.register("mla")
def bench_mla(quick: bool) -> dict[str, Any]:
    """Absorbed vs plain MLA decode steps at a few context lengths (one layer, 1 thread)."""
    torch.set_num_threads(1)
    contexts, seqs, reps = ((256, 1024), 2, 2) if quick else ((1024, 4096), 4, 5)
    cases = {str(c): _case(c, seqs, reps) for c in contexts}
    longest = cases[str(contexts[-1])]
    d = DIMS
    return {
        "batch": seqs,
        "contexts": list(contexts),
        "speedup_absorbed_vs_plain": longest["speedup"],
        "max_rel_diff": max(c["rel_diff"] for c in cases.values()),
        "latent_bytes_per_token_layer": d.row * 4,
        "kv_heads_bytes_per_token_layer": d.heads * (d.qk_dim + d.v_dim) * 4,
        "by_context": cases,
    }

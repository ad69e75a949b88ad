"""Paged attention over the device pool: write this forward's K/V, read each sequence's context.

The pool stores K and V per layer as [capacity, page_size, kv_heads, head_dim]; a sequence's
logical page i lives in device page page_tables[s][i], token at absolute position p sits in
slot p % page_size of logical page p // page_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvstrata.model.layers import apply_rotary


@dataclass
class AttnMeta:
    """Per-forward index tensors shared by every layer (computed once per forward)."""

    slots: torch.Tensor  # [T] flat slot page_id * page_size + offset of each new token
    seq_lens: list[int]  # new tokens per sequence
    ctx_lens: list[int]  # context length of each sequence after this forward
    ctx_slots: list[torch.Tensor]  # per sequence [ctx] flat slots of its whole context, in order
    masks: list[torch.Tensor]  # per sequence [new, ctx] bool (True = may attend)


def build_meta(
    positions: torch.Tensor,
    seq_lens: list[int],
    ctx_lens: list[int],
    page_tables: list[torch.Tensor],
    page_size: int,
) -> AttnMeta:
    """Index tensors for one forward; `positions` [T] are absolute token positions."""
    device = positions.device
    slots, ctx_slots, masks = [], [], []
    start = 0
    for n, ctx, table in zip(seq_lens, ctx_lens, page_tables, strict=True):
        table = table.to(device=device, dtype=torch.long)
        pos = positions[start : start + n]  # [n]
        start += n
        slots.append(table[pos // page_size] * page_size + pos % page_size)
        every = torch.arange(ctx, device=device)  # [ctx]
        ctx_slots.append(table[every // page_size] * page_size + every % page_size)
        # Query at absolute position p sees keys 0..p (positions need not be the last n:
        # context-parallel ranks compute the tokens of the pages they own).
        masks.append(every[None, :] <= pos[:, None])  # [n, ctx]
    flat = torch.cat(slots) if slots else torch.empty(0, dtype=torch.long, device=device)
    return AttnMeta(flat, list(seq_lens), list(ctx_lens), ctx_slots, masks)


EXPAND_KV_FROM = 512
"""Query tokens from which K/V heads are repeated explicitly: CPU SDPA then takes its fused
kernel (2x faster at 1024 queries), while enable_gqa's math path wins for decode and short
chunks (4x at one query), where repeating the heads costs more than it saves."""


class PagedAttention(nn.Module):
    """Multi-head attention with grouped K/V heads (GQA) reading and writing a paged pool."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        k_pool: torch.Tensor,  # [capacity, page_size, kv_heads, head_dim] (a view into the pool)
        v_pool: torch.Tensor,
        meta: AttnMeta,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(t, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        # .view (not reshape) so a non-contiguous pool fails loudly instead of writing a copy.
        k_flat = k_pool.view(-1, self.kv_heads, self.head_dim)  # [capacity * page, kv_heads, dim]
        v_flat = v_pool.view(-1, self.kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slots, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slots, v.to(v_flat.dtype))
        out = torch.empty_like(q)  # [T, heads, head_dim]
        start = 0
        for n, slots, mask in zip(meta.seq_lens, meta.ctx_slots, meta.masks, strict=True):
            qs = q[start : start + n].transpose(0, 1)[None]  # [1, heads, n, dim]
            expand = n >= EXPAND_KV_FROM and self.heads != self.kv_heads
            ks = self._heads(k_flat[slots].to(q.dtype), expand)  # [1, heads or kv_heads, ctx, dim]
            vs = self._heads(v_flat[slots].to(q.dtype), expand)
            o = nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, enable_gqa=self.heads != self.kv_heads and not expand
            )
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        return self.o_proj(out.view(t, self.heads * self.head_dim))

    def _heads(self, kv: torch.Tensor, expand: bool) -> torch.Tensor:
        """[ctx, kv_heads, dim] -> [1, kv_heads or heads, ctx, dim] (K/V heads repeated)."""
        kv = kv.transpose(0, 1)
        if expand:
            kv = kv.repeat_interleave(self.heads // self.kv_heads, dim=0)
        return kv[None]

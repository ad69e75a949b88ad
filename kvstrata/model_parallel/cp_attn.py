"""Attention of one cp rank's queries of a sequence over the whole gathered context.

A cp rank computes the tokens of the pages it owns, so its queries are not the last n positions
in order and no plain causal kernel fits. When the sequence's new tokens are its last ones (a
prefill chunk or a decode step), every prefix key is visible to every query and only the chunk's
own keys need a mask; on CPU the two parts run as separate flash kernels, merged by their
log-sum-exps (the single-rank split route of kvstrata.model.attention):
  prefix  # [1, heads, t, dim] over keys 0 .. ctx-n-1, no mask
  chunk   # [1, heads, t, dim] over keys ctx-n .. ctx-1, additive bias [t, n] (0 / -inf)
so the mask is [t, n] (chunk^2 / cp) instead of [t, ctx]: its size does not grow with the
context. Anything else (hand-built batches, non-CPU devices) takes the general masked path.
"""

from __future__ import annotations

import torch
from torch import nn

from kvstrata.model.attention import merge_by_lse
from kvstrata.model.attn_meta import AttnMeta

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def chunk_bias(rows: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[t, n] additive bias: query at chunk row r sees chunk keys 0..r (0), not the rest."""
    allowed = torch.arange(n, device=rows.device)[None, :] <= rows[:, None]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=rows.device)
    return bias.masked_fill_(~allowed, float("-inf"))


def attend_owned(
    q: torch.Tensor,  # [t, heads, dim] this rank's queries of sequence s
    keys: torch.Tensor,  # [ctx, kv_heads, dim] the sequence's whole context, logical order
    values: torch.Tensor,
    meta: AttnMeta,
    s: int,
    rows: torch.Tensor,  # [t] row of each query among the sequence's n new tokens
    gqa: bool,
    bias: dict[int, torch.Tensor] | None = None,  # per-forward cache of chunk_bias by sequence
) -> torch.Tensor:
    """Attention output  # [t, heads, dim]"""
    n, ctx = meta.seq_lens[s], meta.ctx_lens[s]
    qs = q.transpose(0, 1)[None]  # [1, heads, t, dim]
    if not meta.tail[s] or q.device.type != "cpu":
        o = nn.functional.scaled_dot_product_attention(
            qs, _bhsd(keys), _bhsd(values), attn_mask=meta.masks[s][rows], enable_gqa=gqa
        )
        return o[0].transpose(0, 1)
    cache = {} if bias is None else bias
    if s not in cache:
        cache[s] = chunk_bias(rows, n, q.dtype)
    o, lse = _flash(qs, _bhsd(keys[ctx - n :]), _bhsd(values[ctx - n :]), attn_mask=cache[s])
    if ctx > n:  # a cached prefix before the chunk: visible to every query
        o1, lse1 = _flash(qs, _bhsd(keys[: ctx - n]), _bhsd(values[: ctx - n]))
        o = merge_by_lse(o1, lse1, o, lse)
    return o[0].transpose(0, 1)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[len, heads, dim] -> [1, heads, len, dim] (a view)."""
    return x.transpose(0, 1)[None]

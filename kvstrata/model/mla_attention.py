"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over latent pages.

Per token and layer the pool holds one latent row [D] = [c_kv (kv_lora_rank) | k_pe
(qk_rope_head_dim)]: c_kv after kv_a_layernorm, k_pe already rotated; its first D/2 values in the
K slot, its last D/2 in the V slot (memory/layout.py). No per-head K or V is ever stored.

Two exact ways to attend, equal up to float rounding (tests prove it):
- plain: expand the context's latents by kv_b_proj into per-head keys [nope | k_pe] and values,
  then ordinary attention (cheaper when many queries share the context: prefill);
- absorbed: fold W_UK (kv_b_proj's key rows) into each query, q_lat = q_nope @ W_UK [kv_lora_rank],
  so a head's score is [q_lat | q_pe] . latent row: one-key-head attention straight over the
  stored rows (values = c_kv), and W_UV applied after it. Nothing is expanded per context token,
  so a decode step reads D values per token instead of computing heads x (nope + v): the fast
  path for decode (DeepSeek-V3 shapes, 4 x 4096-token contexts, one layer, 1 thread: 124 ms
  absorbed vs 5027 ms plain per step; see the mla note).
By default each sequence takes the cheaper of the two by their multiply counts per context token:
plain pays kv_lora_rank x heads x (nope + v) once plus n x heads x (qk + v), absorbed pays
n x heads x (D + kv_lora_rank); absorbed wins for n < kv_lora_rank (nope + v) / (D + kv_lora_rank -
qk - v) new tokens (about 170 for DeepSeek-V3), whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvstrata.model.attn_meta import AttnMeta, write_rows
from kvstrata.model.layers import Fused, RMSNorm, apply_rotary, apply_rotary_interleaved
from kvstrata.model.prepack import PackOwner

sdpa = nn.functional.scaled_dot_product_attention


@dataclass(frozen=True)
class MLADims:
    """Sizes of one MLA block (config.json names in the docs)."""

    hidden: int
    heads: int  # num_attention_heads
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (no query LoRA)
    kv_lora_rank: int
    nope_dim: int  # qk_nope_head_dim
    rope_dim: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim
    attention_bias: bool
    rope_interleave: bool
    scaling: float  # softmax scale (qk_head_dim^-0.5, times YaRN's mscale^2 where asked)

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def row(self) -> int:
        """Values of one token's latent row in the pool."""
        return self.kv_lora_rank + self.rope_dim


class MLAttention(PackOwner):
    """MLA reading and writing latent pages; HF parameter names (q_a_proj, kv_b_proj, ...)."""

    def __init__(self, d: MLADims, dtype: torch.dtype) -> None:
        super().__init__()
        self.d = d
        # None: each sequence by the cost rule (module doc); True/False: always absorbed/plain
        self.absorb: bool | None = None
        h, bias = d.heads, d.attention_bias
        if d.q_lora_rank is None:
            self.q_proj = nn.Linear(d.hidden, h * d.qk_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(d.hidden, d.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, 1e-6, dtype)  # transformers' eps
            self.q_b_proj = nn.Linear(d.q_lora_rank, h * d.qk_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(d.hidden, d.row, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, 1e-6, dtype)
        self.kv_b_proj = nn.Linear(d.kv_lora_rank, h * (d.nope_dim + d.v_dim), False, dtype=dtype)
        self.o_proj = nn.Linear(h * d.v_dim, d.hidden, bias=bias, dtype=dtype)
        self.fused: Fused | None = None  # the hidden state's two projections, once fuse() ran
        # True in a NextN (MTP) layer: its entry at position 0 (no target state before it) is
        # not part of DeepSeek's MTP sequence, so no later entry attends to it (see visible)
        self.hide_first = False

    def fuse(self, prepack: bool = False) -> None:
        """The two projections of the hidden state (q_a_proj or q_proj, kv_a_proj_with_mqa) as
        one matmul (see Fused); kv_b_proj stays whole: the absorbed path reads its rows."""
        self.unpack()
        self.fused = Fused.build(self._inputs(), prepack)

    def dense_weights(self) -> dict[str, torch.Tensor]:
        first = "q_proj" if self.d.q_lora_rank is None else "q_a_proj"
        return {} if self.fused is None else self.fused.dense_parts((first, "kv_a_proj_with_mqa"))

    def unpack(self) -> None:
        if self.fused is not None:
            self.fused.unpack(self._inputs())

    def _inputs(self) -> list[nn.Linear]:
        first = self.q_proj if self.d.q_lora_rank is None else self.q_a_proj
        return [first, self.kv_a_proj_with_mqa]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotate = apply_rotary_interleaved if self.d.rope_interleave else apply_rotary
        return rotate(x, cos, sin)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, heads, nope], rotated q_pe [T, heads, rope], latent rows [T, D])."""
        d, t = self.d, x.shape[0]
        parts = self._inputs()
        if self.fused is not None and self.fused.holds(parts):
            q, kv = self.fused(x).split([parts[0].out_features, d.row], dim=-1)
        else:
            q, kv = parts[0](x), parts[1](x)
        if d.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.reshape(t, d.heads, d.qk_dim).split([d.nope_dim, d.rope_dim], dim=-1)
        c, k_pe = kv.split([d.kv_lora_rank, d.rope_dim], dim=-1)
        k_pe = self._rotate(k_pe.view(t, 1, d.rope_dim), cos, sin).view(t, d.rope_dim)
        return q_nope, self._rotate(q_pe, cos, sin), torch.cat((self.kv_a_layernorm(c), k_pe), -1)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, rope_dim]
        sin: torch.Tensor,
        k_pool: torch.Tensor,  # [capacity, page_size, 1, D/2] first halves of the latent rows
        v_pool: torch.Tensor,  # [capacity, page_size, 1, D/2] second halves
        meta: AttnMeta,
        rows: torch.Tensor | None = None,  # [num_seqs] each sequence's last row, or None (all)
    ) -> torch.Tensor:  # [T or num_seqs, hidden]
        q_nope, q_pe, latent = self.project(x, cos, sin)
        half = self.d.row // 2
        write_rows(k_pool.view(-1, 1, half), latent[:, None, :half], meta)
        write_rows(v_pool.view(-1, 1, half), latent[:, None, half:], meta)
        if rows is not None:  # only these queries: each reads its whole context from the pool
            q_nope, q_pe, meta = q_nope[rows], q_pe[rows], meta.last_rows(rows)
        out = torch.empty(
            q_nope.shape[0], self.d.heads, self.d.v_dim, dtype=q_nope.dtype, device=x.device
        )
        start = 0
        for s, n in enumerate(meta.seq_lens):
            rows_s = slice(start, start + n)
            ctx = context_rows(k_pool, v_pool, meta, s).to(q_nope.dtype)  # [ctx, D]
            mask = None if n == 1 and meta.tail[s] else meta.masks[s]
            mask = self.visible(mask, meta, s, torch.arange(n))
            out[rows_s] = self.attend(q_nope[rows_s], q_pe[rows_s], ctx, mask, self.absorbs(n))
            start += n
        return self.o_proj(out.flatten(1))

    def visible(
        self, mask: torch.Tensor | None, meta: AttnMeta, s: int, rows: torch.Tensor
    ) -> torch.Tensor | None:
        """Sequence s's mask [t, ctx] for its query rows `rows` [t] (None: all visible), with
        key position 0 hidden from every query past it when hide_first."""
        if not self.hide_first:
            return mask
        pos = meta.positions[sum(meta.seq_lens[:s]) + rows]  # [t] the queries' positions
        ctx = meta.ctx_lens[s]
        if mask is None:
            mask = torch.ones(len(rows), ctx, dtype=torch.bool, device=pos.device)
        mask = mask.clone()
        mask[:, 0] = pos == 0  # position 0 sees itself (its only key), nobody else sees it
        return mask

    def absorbs(self, n: int) -> bool:
        """Whether n new queries of a sequence attend in latent space (see `absorb`)."""
        if self.absorb is not None:
            return self.absorb
        d = self.d
        return n * (d.row + d.kv_lora_rank - d.qk_dim - d.v_dim) < d.kv_lora_rank * (
            d.nope_dim + d.v_dim
        )

    def attend(
        self,
        q_nope: torch.Tensor,  # [n, heads, nope]
        q_pe: torch.Tensor,  # [n, heads, rope] rotated
        ctx: torch.Tensor,  # [ctx, D] the sequence's latent rows, in the queries' dtype
        mask: torch.Tensor | None,  # [n, ctx] bool, True = may attend; None: all visible
        absorb: bool,
    ) -> torch.Tensor:
        """Attention output of n queries over a context of latent rows  # [n, heads, v_dim]"""
        return (self._absorbed if absorb else self._plain)(q_nope, q_pe, ctx, mask)

    def _plain(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Keys and values expanded per head from the latents  # [n, heads, v_dim]"""
        d, length = self.d, ctx.shape[0]
        c, k_pe = ctx.split([d.kv_lora_rank, d.rope_dim], dim=-1)
        kv = self.kv_b_proj(c).view(length, d.heads, d.nope_dim + d.v_dim)
        k_nope, v = kv.split([d.nope_dim, d.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, d.heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        o = sdpa(_bhsd(q), _bhsd(k), _bhsd(v), attn_mask=mask, scale=d.scaling)
        return o[0].transpose(0, 1)

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention in latent space: one shared key/value row per token  # [n, heads, v_dim]"""
        d = self.d
        w = self.kv_b_proj.weight.view(d.heads, d.nope_dim + d.v_dim, d.kv_lora_rank)
        w_uk, w_uv = w.split([d.nope_dim, d.v_dim], dim=1)  # [heads, nope|v, kv_lora_rank]
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)  # [n, heads, kv_lora_rank]
        n = q_nope.shape[0]
        q = torch.cat((q_lat, q_pe), dim=-1).view(n * d.heads, d.row)  # scores vs whole rows
        # one key "head" shared by all: every (query, head) pair is a row of one matmul
        scores = torch.mm(q, ctx.t()).mul_(d.scaling)  # [n * heads, ctx]
        if mask is not None:
            scores = scores.view(n, d.heads, -1).masked_fill_(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores.view(n * d.heads, -1).float(), dim=-1).to(ctx.dtype)
        o = torch.mm(probs, ctx[:, : d.kv_lora_rank]).view(n, d.heads, d.kv_lora_rank)
        return torch.einsum("nhr,hvr->nhv", o, w_uv)  # W_UV after attention


def context_rows(
    k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMeta, s: int
) -> torch.Tensor:
    """Latent rows of positions 0..ctx-1 of sequence s, whole pages gathered then cut
    # [ctx, D] in the pool's dtype"""
    ctx = meta.ctx_lens[s]
    pages = meta.page_tables[s][: -(-ctx // meta.page_size)]
    halves = [pool.index_select(0, pages).flatten(0, 2)[:ctx] for pool in (k_pool, v_pool)]
    return torch.cat(halves, dim=-1)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[len, heads, dim] -> [1, heads, len, dim] (a view)."""
    return x.transpose(0, 1)[None]

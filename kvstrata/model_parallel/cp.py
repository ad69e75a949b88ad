"""Context parallel over a page-sharded device pool: a rank computes the tokens of its pages.

Ownership is a fixed rule of the page id (kvstrata.memory.cp_ownership.CPOwnership): owner =
id % cp, local slot = id // cp; the DevicePool(n_shards=cp, rank=r) of rank r holds only its
pages, and rank r computes exactly the new tokens whose page it owns (its KV is written locally;
no KV moves on write). Per layer l:
  scratch  # [2, n_pages, page, kv_heads, head_dim]: the batch's pages (each once, logical
             order) gathered from their owners by CPGather, double-buffered: layer l+1's async
             all_gather runs while layer l computes (it packs pool pages written before this
             forward, so it may start early; host loads of layer l+1 are waited for first)
  new      # [cp, 2, m, kv_heads, head_dim]: every rank's new-token K/V of layer l, one
             synchronous all_gather (m = most new tokens any rank computes; padded)
The new K/V overlay the scratch (whatever the early gather packed for those slots is stale),
each rank attends for its own tokens over the whole context (kvstrata.model_parallel.cp_attn: prefix
unmasked + chunk under a [t, n] bias), and the owner keeps its new K/V in its pool. The logits
of a token are computed by its owner only; one all_reduce(SUM) of [rows, vocab] with zeros
elsewhere gives every rank the same bits (x + 0 == x).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvstrata.memory.cp_ownership import CPOwnership
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool
from kvstrata.model.attn_meta import AttnMeta, build_meta
from kvstrata.model.decoder import DecoderLayer, DecoderLM, ForwardArgs, ModelPart, SeqBatch
from kvstrata.model.mla_attention import MLAttention
from kvstrata.model_parallel.cp_attn import attend_owned
from kvstrata.model_parallel.cp_gather import CPGather, make_plan
from kvstrata.model_parallel.pp import PipelineStage

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def batch_pages(batch: SeqBatch, page_size: int) -> tuple[list[int], list[torch.Tensor]]:
    """(unique page ids in logical order, each sequence's table remapped to scratch indices)."""
    index: dict[int, int] = {}
    tables = []
    for table, ctx in zip(batch.page_tables, batch.ctx_lens, strict=True):
        used = [int(p) for p in table[: -(-ctx // page_size)]]
        tables.append(torch.tensor([index.setdefault(p, len(index)) for p in used]))
    return list(index), tables


@dataclass
class CPPlan:
    """Which new tokens this rank computes and how every rank's new K/V come back in order."""

    mine: torch.Tensor  # [t] indices (into the batch's T tokens) of this rank's tokens
    rows: torch.Tensor  # [T] row of each batch token in the gathered [cp * m] new-KV rows
    per_rank: int  # m
    seq_rows: list[tuple[torch.Tensor, torch.Tensor]]  # per seq: (rows of x, rows of its mask)
    keep_src: torch.Tensor  # scratch slots of this rank's new tokens
    keep_dst: torch.Tensor  # their local pool slots
    bias: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk masks, shared by layers


def plan_tokens(
    own: CPOwnership, rank: int, batch: SeqBatch, slots: torch.Tensor, page_size: int
) -> CPPlan:
    """Every rank derives the same split from the same batch (no exchange needed)."""
    starts = torch.tensor([0, *batch.seq_lens]).cumsum(0).tolist()
    page = torch.cat(
        [
            table[batch.positions[a : a + n] // page_size]
            for table, a, n in zip(batch.page_tables, starts, batch.seq_lens, strict=False)
        ]
    )  # [T] logical page id of each new token
    owner = page % own.cp
    counts = torch.bincount(owner, minlength=own.cp)
    m = int(counts.max())
    rank_of = torch.argsort(owner, stable=True)  # tokens grouped by owner, batch order within
    first = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]])
    rows = torch.empty_like(page)
    rows[rank_of] = owner[rank_of] * m + (torch.arange(len(page)) - first[owner[rank_of]])
    mine = torch.nonzero(owner == rank).squeeze(1)
    local_row = torch.full_like(page, -1)
    local_row[mine] = torch.arange(len(mine))
    seq_rows = []
    for a, n in zip(starts, batch.seq_lens, strict=False):
        js = mine[(mine >= a) & (mine < a + n)]
        seq_rows.append((local_row[js], js - a))
    pos = batch.positions[mine]
    keep_dst = (page[mine] // own.cp) * page_size + pos % page_size
    return CPPlan(mine, rows, m, seq_rows, slots[mine], keep_dst)


class CPModel(ModelPart):
    """A model part (DecoderLM's forward call) over a sharded DevicePool."""

    def __init__(
        self,
        model: DecoderLM,
        cp: int,
        cp_rank: int,
        group: Any = None,
        stage: PipelineStage | None = None,
    ) -> None:
        """With `stage` (pp > 1) only that stage's layers run: the hidden states of this rank's
        tokens go to the same cp rank of the next stage (the token split is the same there)."""
        self.model, self.own, self.rank, self.group = model, CPOwnership(cp), cp_rank, group
        self.spec, self.fingerprint = model.spec, model.fingerprint
        self.stage = stage
        self.layers = list(stage.layers if stage is not None else model.model.layers)
        self.norm = model.model.norm  # before the LM head (an MTP head has its own)
        self._gather: CPGather | None = None
        self.tokens_computed = 0  # new tokens this rank ran through the layers (balance checks)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def kv_shape(self, page_size: int, dtype: str | None = None) -> KVShape:
        if self.stage is not None:
            return self.stage.kv_shape(page_size, dtype)
        return self.model.kv_shape(page_size, dtype)

    def _gatherer(self, kv: DevicePool) -> CPGather:
        if kv.n_shards != self.own.cp or kv.rank != self.rank:
            raise ValueError(
                f"kv: pool shards {kv.n_shards}/rank {kv.rank} != cp {self.own.cp}/{self.rank}"
            )
        # by storage, not object: a draft's pool view (DraftKV.data) is a new slice per call
        g = self._gather
        if g is None or (g.kv.data_ptr(), g.kv.shape) != (kv.data.data_ptr(), kv.data.shape):
            self._gather = CPGather(self.own, kv.data, self.rank, self.group)
        return self._gather

    def _exchange(self, k: torch.Tensor, v: torch.Tensor, p: CPPlan) -> torch.Tensor:
        """Every rank's new K/V in batch order  # [2, T, kv_heads, head_dim]"""
        send = k.new_zeros((2, p.per_rank, *k.shape[1:]))  # [2, m, kv_heads, dim]
        send[0, : k.shape[0]], send[1, : v.shape[0]] = k, v
        recv = k.new_empty((self.own.cp * 2, p.per_rank, *k.shape[1:]))  # ranks' sends stacked
        _all_gather_single(recv, send, group=self.group)
        flat = (
            recv.view(self.own.cp, 2, p.per_rank, *k.shape[1:])
            .transpose(0, 1)
            .reshape(2, -1, *k.shape[1:])
        )  # [2, cp * m, heads, dim]
        return flat[:, p.rows]

    def _layer(
        self,
        layer: DecoderLayer,
        x: torch.Tensor,  # [t, hidden] this rank's tokens
        rope: tuple[torch.Tensor, torch.Tensor],  # [t, head_dim] each
        scratch: torch.Tensor,  # [2, n_pages, page, kv_heads, head_dim]
        meta: AttnMeta,
        p: CPPlan,
    ) -> torch.Tensor:
        attn, t = layer.self_attn, x.shape[0]
        h = layer.input_layernorm(x)
        if isinstance(attn, MLAttention):
            x = x + self._latent_attention(attn, h, rope, scratch, meta, p)
            return x + layer.mlp(layer.post_attention_layernorm(x))
        q, k, v = attn.qkv(h, *rope)
        new = self._exchange(k, v, p)  # [2, T, kv_heads, dim]
        flat = scratch.view(2, -1, attn.kv_heads, attn.head_dim)  # [2, n_pages * page, ...]
        flat.index_copy_(1, meta.slots, new.to(flat.dtype))
        out = torch.empty_like(q)  # [t, heads, dim]
        gqa = attn.heads != attn.kv_heads
        for s, ((xr, mr), slots) in enumerate(zip(p.seq_rows, meta.ctx_slots, strict=True)):
            if xr.numel():
                keys, values = flat[0, slots].to(q.dtype), flat[1, slots].to(q.dtype)
                out[xr] = attend_owned(q[xr], keys, values, meta, s, mr, gqa, p.bias)
        x = x + attn.o_proj(out.view(t, attn.heads * attn.head_dim))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _latent_attention(
        self,
        attn: MLAttention,
        h: torch.Tensor,  # [t, hidden] this rank's tokens, normed
        rope: tuple[torch.Tensor, torch.Tensor],
        scratch: torch.Tensor,  # [2, n_pages, page, 1, D/2]: latent rows' halves (layout.py)
        meta: AttnMeta,
        p: CPPlan,
    ) -> torch.Tensor:
        """MLA over latent pages: the new latent rows' halves travel as K and V do."""
        q_nope, q_pe, latent = attn.project(h, *rope)  # latent [t, D]
        half = latent.shape[1] // 2
        new = self._exchange(latent[:, None, :half], latent[:, None, half:], p)  # [2, T, 1, D/2]
        flat = scratch.view(2, -1, 1, half)  # [2, n_pages * page, 1, D/2]
        flat.index_copy_(1, meta.slots, new.to(flat.dtype))
        out = q_nope.new_empty((h.shape[0], attn.d.heads, attn.d.v_dim))
        for s, ((xr, mr), slots) in enumerate(zip(p.seq_rows, meta.ctx_slots, strict=True)):
            if xr.numel():
                rows = torch.cat((flat[0, slots], flat[1, slots]), -1).flatten(1).to(h.dtype)
                mask = attn.visible(meta.masks[s][mr], meta, s, mr)  # [t_s, ctx]
                absorb = attn.absorbs(meta.seq_lens[s])
                out[xr] = attn.attend(q_nope[xr], q_pe[xr], rows, mask, absorb)
        return attn.o_proj(out.flatten(1))

    @torch.no_grad()
    def run(self, a: ForwardArgs) -> torch.Tensor:
        """Logits fp32 [T or num_seqs, vocab], identical on every cp rank; `hidden_out` gets
        the last layer's output [T, hidden] (before the norm; see full_rows)."""
        batch, kv, before_layer, last_only, hidden_out = (
            a.batch, a.kv, a.before_layer, a.last_only, a.hidden_out,
        )  # fmt: skip
        page_size, m = kv.shape.page_size, self.model
        batch.validate(page_size, kv.capacity)
        gather = self._gatherer(kv)
        pages, tables = batch_pages(batch, page_size)
        meta = build_meta(batch.positions, batch.seq_lens, batch.ctx_lens, tables, page_size)
        p = plan_tokens(self.own, self.rank, batch, meta.slots, page_size)
        plan = make_plan(self.own, pages, self.rank, kv.device)
        self.tokens_computed += len(p.mine)
        x = self._input(batch, p)  # [t, hidden]
        rope = m.rotary.tables(batch.positions[p.mine], x.dtype)
        n_layers = len(self.layers)
        for i in range(-1, n_layers):
            if i + 1 < n_layers:
                if before_layer is not None:
                    before_layer(i + 1)  # the gather packs from the pool: loads land first
                gather.start(plan, i + 1)  # overlaps layer i's compute
            if i < 0:
                continue
            scratch = gather.finish(plan, i)  # [2, n_pages, page, kv_heads, head_dim]
            x = self._layer(self.layers[i], x, rope, scratch, meta, p)
            local = kv.data[i].view(2, -1, *scratch.shape[3:])  # [2, cap_local * page, ...]
            flat = scratch.view(2, -1, *scratch.shape[3:])
            local.index_copy_(1, p.keep_dst, flat.index_select(1, p.keep_src))  # owned only
        if hidden_out is not None:
            hidden_out.append(self.full_rows(x, batch, p))
        return self._output(x, batch, p, last_only)

    def full_rows(self, x: torch.Tensor, batch: SeqBatch, p: CPPlan) -> torch.Tensor:
        """Every token's row of x [t, hidden] from its owner  # [T, hidden]: zeros elsewhere and
        one all_reduce(SUM) over cp (exact). On a pipeline stage before the last: zeros (an MTP
        head runs on the last stage; the others never read them)."""
        full = x.new_zeros((batch.input_ids.shape[0], x.shape[1]))
        if self.stage is not None and not self.stage.is_last:
            return full
        full[p.mine] = x
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group)
        return full

    def _input(self, batch: SeqBatch, p: CPPlan) -> torch.Tensor:
        """This rank's tokens embedded, or their hidden states from the previous stage."""
        st, emb = self.stage, self.model.model.embed_tokens
        if st is None or st.stage == 0:
            return emb(batch.input_ids[p.mine])
        x = emb.weight.new_empty((len(p.mine), self.spec.hidden_size))
        if len(p.mine):  # the sender knows the same count: both skip empty transfers
            dist.recv(x, src=st.ranks[st.stage - 1])
        return x

    def _output(self, x: torch.Tensor, batch: SeqBatch, p: CPPlan, last_only: bool) -> torch.Tensor:
        st = self.stage
        if st is None:
            return self._logits(x, batch, p, last_only)
        if st.is_last:
            out = self._logits(x, batch, p, last_only)
        else:
            if len(p.mine):
                dist.send(x.contiguous(), dst=st.ranks[st.stage + 1])
            rows = len(batch.seq_lens) if last_only else batch.input_ids.shape[0]
            out = torch.empty(rows, self.vocab_size, dtype=torch.float32)
        dist.broadcast(out, src=st.ranks[-1], group=st.group)
        return out

    def _logits(self, x: torch.Tensor, batch: SeqBatch, p: CPPlan, last_only: bool) -> torch.Tensor:
        """Each token's logits from its owner, summed with zeros elsewhere  # [rows, vocab]"""
        m, t_all = self.model, batch.input_ids.shape[0]
        want = torch.arange(t_all)
        if last_only:
            want = torch.tensor(batch.seq_lens).cumsum(0) - 1  # [num_seqs]
        where = torch.full((t_all,), -1, dtype=torch.long)
        where[p.mine] = torch.arange(len(p.mine))
        local = where[want]
        have = torch.nonzero(local >= 0).squeeze(1)
        out = torch.zeros(len(want), m.vocab_size, dtype=torch.float32)
        if have.numel():
            out[have] = self._project(x[local[have]])
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """Norm and LM head of owned rows: [rows, hidden] -> fp32 [rows, vocab]."""
        m = self.model
        weight = m.model.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
        return nn.functional.linear(self.norm(x), weight).float()

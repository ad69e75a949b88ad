"""Pipeline parallel: a stage runs a contiguous run of layers and keeps only their KV.

Stage s of pp holds layers [bounds[s], bounds[s+1]) (split as evenly as possible). Its device and
host pools have that many layers under the same logical page ids as every other stage, so the
tree, the page ids and every cache decision are the same on all stages; only the bytes differ.
A forward: stage 0 embeds, each stage runs its layers and sends the hidden states to the next
(point to point, over the global rank of the same tp/cp position in the next stage), the last
stage applies the final norm and LM head, then broadcasts the logits over the pp group so every
stage samples the same token. Host copies finishing at different times on each stage are
reconciled by the step consensus like any other asynchronous event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvstrata.memory.layout import KVShape
from kvstrata.model.attn_meta import build_meta
from kvstrata.model.decoder import DecoderLM, KVPool, SeqBatch


def stage_bounds(num_layers: int, pp: int) -> list[int]:
    """Layer boundaries [b0=0, b1, ..., b_pp=num_layers]; each stage gets >= 1 layer."""
    if pp < 1 or pp > num_layers:
        raise ValueError(f"pp must be in [1, num_layers={num_layers}], got {pp}")
    return [round(s * num_layers / pp) for s in range(pp + 1)]


class PipelineStage:
    """Callable like DecoderLM (same forward signature) for one pipeline stage."""

    def __init__(
        self, model: DecoderLM, pp: int, stage: int, ranks: list[int], group: Any = None
    ) -> None:
        """`ranks`: the global rank of each stage's peer (this rank's pp group, stage order)."""
        if len(ranks) != pp or not 0 <= stage < pp:
            raise ValueError(f"stage must be in [0, pp={pp}) with one rank per stage: {ranks}")
        bounds = stage_bounds(model.spec.num_layers, pp)
        self.first, self.end = bounds[stage], bounds[stage + 1]
        self.pp, self.stage, self.ranks, self.group = pp, stage, ranks, group
        self.spec = model.spec
        self.fingerprint = model.fingerprint
        self.dtype_name = model.dtype_name
        self.layers = nn.ModuleList(model.model.layers[self.first : self.end])
        self.embed = model.model.embed_tokens  # stage 0 embeds; the last (tied) head may use it
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.rotary = model.rotary

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    def kv_shape(self, page_size: int, dtype: str | None = None) -> KVShape:
        """This stage's paged KV: only its layers."""
        s = self.spec
        return KVShape(
            self.end - self.first, s.num_kv_heads, s.head_dim, page_size, dtype or self.dtype_name
        )

    @torch.no_grad()
    def __call__(
        self,
        batch: SeqBatch,
        kv: KVPool,
        before_layer: Callable[[int], None] | None = None,
        last_only: bool = False,
        hidden_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits fp32 [T or num_seqs, vocab], identical on every stage. `hidden_out` gets the
        last layer's output [T, hidden] on the last stage (an MTP head's input: the head runs
        there), zeros on the others (never read: they only receive the head's logits)."""
        capacity, page_size = kv.k(0).shape[:2]
        batch.validate(page_size, capacity)
        device = self.embed.weight.device
        ids, positions = batch.input_ids.to(device), batch.positions.to(device)
        meta = build_meta(positions, batch.seq_lens, batch.ctx_lens, batch.page_tables, page_size)
        t, hidden = ids.shape[0], self.spec.hidden_size
        if self.stage == 0:
            x = self.embed(ids)  # [T, hidden]
        else:
            x = torch.empty(t, hidden, dtype=self.embed.weight.dtype, device=device)
            dist.recv(x, src=self.ranks[self.stage - 1])
        rope = self.rotary.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)  # local layer index: this stage's pool has only its layers
            x = layer(x, rope, kv.k(i), kv.v(i), meta)
        n_out = len(batch.seq_lens) if last_only else t
        logits = torch.empty(n_out, self.vocab_size, dtype=torch.float32, device=device)
        if not self.is_last:
            dist.send(x.contiguous(), dst=self.ranks[self.stage + 1])
            if hidden_out is not None:
                hidden_out.append(torch.zeros_like(x))
        else:
            if hidden_out is not None:
                hidden_out.append(x)
            if last_only:
                x = x[torch.tensor(batch.seq_lens, device=device).cumsum(0) - 1]
            weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
            logits = nn.functional.linear(self.norm(x), weight).float()
        dist.broadcast(logits, src=self.ranks[-1], group=self.group)
        return logits  # [T or num_seqs, vocab]

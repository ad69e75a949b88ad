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

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvstrata.memory.layout import KVShape
from kvstrata.model.decoder import DecoderLM, ForwardArgs, LayerRun, ModelPart, head_logits


def stage_bounds(num_layers: int, pp: int) -> list[int]:
    """Layer boundaries [b0=0, b1, ..., b_pp=num_layers]; each stage gets >= 1 layer."""
    if pp < 1 or pp > num_layers:
        raise ValueError(f"pp must be in [1, num_layers={num_layers}], got {pp}")
    return [round(s * num_layers / pp) for s in range(pp + 1)]


class PipelineStage(ModelPart):
    """A model part (DecoderLM's forward call) for one pipeline stage."""

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
        self.head_packed = model.head_packed  # the last stage's LM head, prepacked (or None)
        self.kv_layout = model.kv_shape(1).layout  # "gqa" K/V heads or "mla" latent rows

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    def kv_shape(self, page_size: int, dtype: str | None = None) -> KVShape:
        """This stage's paged KV: only its layers."""
        s = self.spec
        n, dtype = self.end - self.first, dtype or self.dtype_name
        return KVShape(n, s.num_kv_heads, s.head_dim, page_size, dtype, self.kv_layout)

    @torch.inference_mode()  # as DecoderLM's: outputs are read, never updated
    def run(self, a: ForwardArgs) -> torch.Tensor:
        """Logits fp32 [T or num_seqs, vocab], identical on every stage. `hidden_out` gets the
        last layer's output [T, hidden] on the last stage (an MTP head's input: the head runs
        there), zeros on the others (never read: they only receive the head's logits)."""
        batch, kv, before_layer, last_only, hidden_out = (
            a.batch, a.kv, a.before_layer, a.last_only, a.hidden_out,
        )  # fmt: skip
        device = self.embed.weight.device
        f = LayerRun.start(batch, kv, device)
        t, hidden = f.ids.shape[0], self.spec.hidden_size
        if self.stage == 0:
            x = self.embed(f.ids)  # [T, hidden]
        else:
            x = torch.empty(t, hidden, dtype=self.embed.weight.dtype, device=device)
            dist.recv(x, src=self.ranks[self.stage - 1])
        # before_layer takes local layer indices: this stage's pool has only its layers
        prune = self.is_last and last_only and hidden_out is None  # the last layer of all
        x = f.run(self.layers, x, kv, self.rotary, before_layer, prune)
        if not self.is_last:
            rows = len(batch.seq_lens) if last_only else t
            logits = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=device)
            dist.send(x.contiguous(), dst=self.ranks[self.stage + 1])
            if hidden_out is not None:
                hidden_out.append(torch.zeros_like(x))
        else:
            if hidden_out is not None:
                hidden_out.append(x)
            weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
            logits = head_logits(
                self.norm, weight, self.head_packed, f.last_rows(x) if last_only else x
            )
        dist.broadcast(logits, src=self.ranks[-1], group=self.group)
        return logits  # [T or num_seqs, vocab]

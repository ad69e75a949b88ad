"""Speculative decoding on tp x cp x pp ranks: where the draft's layers live and who runs it.

The draft's KV is packed as tail layers of every page (kvstrata.model.draft), and a rank's
pools hold its PagePart of every page, so placing the draft is choosing which ranks hold
those tail layers:
- PP: the last stage. It holds the LM head and the target's final hidden states (the input of
  an MTP head), so the draft runs there with no extra transfer of hidden states; its pages'
  part is [first target layer of the stage, target + draft layers). It broadcasts the draft's
  logits over the pp group like the target's, so every stage runs the same Speculator steps
  (StageDraft) on the same bits.
- CP: like the target. The draft's tail layers of a page live on the page's owner (id % cp);
  the draft runs through the same per-layer gather (CPModel over the pool's draft layers,
  CPHead for an MTP head), and its logits are summed from the owners: the same on every rank.
- TP: a draft model is sharded by heads like the target (its tail layers hold this rank's
  heads). An MTP head is not sharded: over latent (MLA) pages every tp rank holds the whole
  page and the full hidden state (after the all-reduce), so each rank runs the whole head and
  computes the same head KV and states (tp rank 0 alone writes their storage units, as for the
  target's latent); over per-head (GQA) pages it is refused with --tp > 1.
Every rank then holds the same logits for every draft and verify row, so proposals, accept
counts and (with sampling) every draw from a request's generator are the same everywhere; the
engine also logs each verify's (drafted, accepted, emitted) in the rank's DecisionLog, so the
step consensus's live check names a rank that would decide otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kvstrata.engine.config import EngineConfig
from kvstrata.engine.mtp_speculator import MTPSpeculator
from kvstrata.engine.speculative import Speculator
from kvstrata.model.checkpoint import parse_spec, read_config
from kvstrata.model.decoder import ModelSpec, SeqBatch
from kvstrata.model.deepseek import MLASpec
from kvstrata.model.mtp import MTPHead, is_head_draft
from kvstrata.model_parallel.cp import CPModel, CPPlan
from kvstrata.model_parallel.pp import PipelineStage
from kvstrata.model_parallel.tp import shard_tp
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.group import RankContext

MTP_TP = (
    "--spec-draft mtp:... / nextn is not supported with --tp > 1 on a per-head (GQA) target (the "
    "MTP head's layer is not sharded by heads); use --cp / --pp, or a draft model (self:K or a "
    "checkpoint)"
)


def latent_spec(spec: ModelSpec) -> bool:
    """The target's pages are latent (MLA): no head axis, the same on every tp rank."""
    return isinstance(spec, MLASpec)


def check_spec_layout(engine_cfg: EngineConfig, dist_cfg: DistConfig) -> None:
    """ValueError, before any rank starts, for a draft this layout cannot run."""
    if not is_head_draft(engine_cfg.spec_draft) or dist_cfg.tp == 1:
        return
    if not engine_cfg.model or not latent_spec(parse_spec(read_config(engine_cfg.model))):
        raise ValueError(MTP_TP)


class StageDraft:
    """The draft as one pipeline stage sees it: the last stage runs it (it holds the draft's
    layers) and broadcasts the logits over the pp group; the others receive them. An MTP head
    also returns its outputs g [T, hidden]: real on the last stage, zeros elsewhere (there they
    only feed the next call, whose inputs the other stages never read). `inner` is None on
    the other stages: they hold no draft weights once placed (build_speculator loads them on
    every rank, as the page shape needs the draft's layer count)."""

    def __init__(self, inner: Any, stage: PipelineStage, mtp: bool, hidden_size: int) -> None:
        self.inner, self.stage, self.mtp, self.hidden_size = inner, stage, mtp, hidden_size

    def __call__(self, batch: SeqBatch, *args: Any, last_only: bool = False, **kw: Any) -> Any:
        st, t = self.stage, batch.input_ids.shape[0]
        device = st.embed.weight.device
        g = None
        if st.is_last:
            assert self.inner is not None
            out = self.inner(batch, *args, last_only=last_only, **kw)
            logits, g = out if self.mtp else (out, None)
        else:
            rows = len(batch.seq_lens) if last_only else t
            logits = torch.empty(rows, st.vocab_size, dtype=torch.float32, device=device)
            if self.mtp:
                g = torch.zeros(t, self.hidden_size, device=device)
        dist.broadcast(logits, src=st.ranks[-1], group=st.group)
        return (logits, g) if self.mtp else logits  # [rows, vocab] (, [T, hidden])


class CPHead(CPModel):
    """An MTP head under context parallel: its one layer runs like a target layer (the owner of
    a token's page computes its entry over the gathered head KV, kept in the owner's pool).
    `hidden` rows [T, hidden] are the full rows every rank has (CPModel.full_rows)."""

    def __init__(self, head: MTPHead, cp: int, cp_rank: int, group: Any = None) -> None:
        super().__init__(head.target[0], cp, cp_rank, group)
        self.head = head
        self.layers = [head.layer]
        self.norm = head.norm
        self._hidden = torch.empty(0)

    def __call__(  # type: ignore[override]
        self,
        batch: SeqBatch,
        hidden: torch.Tensor,
        kv: Any,
        last_only: bool = False,
        before_layer: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits fp32 [T or num_seqs, vocab], g [T, hidden]), as MTPHead.forward."""
        self._hidden = hidden  # read by _input, for this rank's tokens
        g: list[torch.Tensor] = []
        logits = super().__call__(batch, kv, before_layer, last_only, hidden_out=g)
        return logits, g[0]

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """The head's own norm and (possibly reduced) output head  # [rows, vocab]"""
        return self.head.logits(x)

    def _input(self, batch: SeqBatch, p: CPPlan) -> torch.Tensor:
        """The head's entry inputs x_j (MTPHead.entry_input) of this rank's tokens [t, hidden]."""
        return self.head.entry_input(batch.input_ids[p.mine], self._hidden[p.mine])


def place_speculator(
    spec: Speculator, ctx: RankContext, stage: PipelineStage | None, target_layers: int
) -> None:
    """Give `spec` (build_speculator's, for the whole model) this rank's view: its draft layers
    start after the rank's `target_layers` pool layers, and its draft runs as the layout does."""
    cfg = ctx.config
    mtp = isinstance(spec, MTPSpeculator)
    if mtp:
        assert isinstance(spec, MTPSpeculator)
        if cfg.tp > 1 and not latent_spec(spec.draft.target[0].spec):
            raise ValueError(MTP_TP)
        spec.place(target_layers)
        spec.states.active = stage is None or stage.is_last
        spec.states.group = ctx.cp_group if cfg.cp > 1 else None
    else:
        spec.offset = target_layers
    draft: Any = spec.draft
    hidden_size = draft.eh_proj.out_features if mtp else draft.spec.hidden_size
    if stage is not None and not stage.is_last:
        # a stage before the last never runs the draft: it keeps no draft weights (its tp and
        # cp peers are on the same stage, so they skip the same wrapping)
        spec.draft = StageDraft(None, stage, mtp, hidden_size)
        return
    if not mtp:
        draft = shard_tp(draft, cfg.tp, ctx.tp_rank, ctx.tp_group)
    if cfg.cp > 1:
        cls = CPHead if mtp else CPModel
        draft = cls(draft, cfg.cp, ctx.cp_rank, ctx.cp_group)
    if stage is not None:
        draft = StageDraft(draft, stage, mtp, hidden_size)
    spec.draft = draft

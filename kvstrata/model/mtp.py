"""An MTP (NextN-style) draft head: one decoder layer over the target's hidden states.

Entry j of the head's sequence takes the target's last hidden state at position j-1 (before
the final norm) and the embedding of token j:

    x_j = eh_proj([enorm(embed(t_j)) ; hnorm(h_{j-1})])        [T, 2*hidden] -> [T, hidden]
    g_j = layer(x_j)  (its own KV at position j: one tail layer of the page)
    logits_j = head(norm(g_j))  -> predicts t_{j+1}

so entry j needs tokens <= j and target states < j only, the same prefix a page's target KV
needs. Embedding and output head are the target's (shared, like DeepSeek-V3's MTP modules).

Entry 0 takes h = 0 (nothing precedes it). A prefix hit never produces the target's hidden
states, so each page keeps h at its last position inside the page (kvstrata.model.page_state):
the entry after a page boundary reads it from there, the real state a cold run computes.

A head may score only part of the vocabulary (`vocab_ids`, a trained draft's choice: the target
tokens its training data needed): its output head is then those rows of the target's, its logits
-inf at every other id. The target still verifies every draft, so outputs are unchanged; the
draft pass reads a fraction of the shared head's weights.

`mtp:random` is a head with fixed random weights (seeded; for tests), `mtp:PATH` a safetensors
file of this module's state dict (save_head writes one; `vocab_ids` [K] int64 is in it when set).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file
from torch import nn

from kvstrata.memory.layout import DTYPES
from kvstrata.model.attn_meta import build_meta
from kvstrata.model.decoder import DecoderLM, KVPool, SeqBatch
from kvstrata.model.layers import RMSNorm
from kvstrata.model.prepack import Prepacked

VOCAB_IDS = "vocab_ids"  # the state-dict entry of a reduced-vocabulary head

MTP_PREFIX = "mtp:"
NEXTN = "nextn"  # the checkpoint's own NextN layer (kvstrata.model.nextn)
RANDOM = "random"
RANDOM_SEED = 20260  # mtp:random: the same weights in every process


class MTPHead(nn.Module):
    """One NextN layer over a target's geometry; inference only."""

    vocab_ids: torch.Tensor | None
    KIND = ""  # a subclass's name for its own computation (in the fingerprint)

    def __init__(self, target: DecoderLM) -> None:
        super().__init__()
        s, dtype = target.spec, DTYPES[target.dtype_name]
        self.enorm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.eh_proj = nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False, dtype=dtype)
        # the block the target would have at index num_layers (MLA + MoE for DeepSeek-V3)
        self.layer = target.make_layer(s.num_layers, dtype)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.target = [target]  # a list: not a submodule (its weights are not the head's)
        self.fingerprint = ""
        self.register_buffer(VOCAB_IDS, None)  # [K] int64, sorted (set_vocab); None: every id
        self._rows: torch.Tensor | None = None  # [K, hidden]: the target head's vocab_ids rows
        self._packed: Prepacked | None = None  # _rows in oneDNN's layout (CPU fp32)
        self.requires_grad_(False)

    def set_vocab(self, ids: torch.Tensor) -> None:
        """Score only target ids `ids` [K] (distinct, sorted; saved with the head's weights)."""
        ids = ids.to(torch.int64)
        if ids.dim() != 1 or not len(ids) or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError("vocab_ids: a non-empty, strictly increasing list of token ids")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.target[0].vocab_size:
            raise ValueError(f"vocab_ids: ids outside 0..{self.target[0].vocab_size - 1}")
        self.register_buffer(VOCAB_IDS, ids)
        self._rows = self._packed = None

    def out_weight(self) -> torch.Tensor:
        """The full output head [vocab, hidden]: the target's (shared)."""
        target = self.target[0]
        return target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight

    def entry_input(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """x_j = eh_proj([enorm(embed(t_j)); hnorm(h_{j-1})]): ids [T], target states
        [T, hidden] (before the final norm) -> [T, hidden]."""
        emb = self.target[0].model.embed_tokens(input_ids)  # [T, hidden]
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden.to(emb.dtype))], dim=-1))

    def head_rows(self) -> torch.Tensor:
        """The output head's weight this draft scores with: [K or vocab, hidden]."""
        weight = self.out_weight()
        if self.vocab_ids is None:
            return weight
        if self._rows is None or self._rows.device != weight.device:
            with torch.no_grad():
                self._rows = weight.index_select(0, self.vocab_ids.to(weight.device))
            self._packed = Prepacked.build(self._rows, None)
        return self._rows

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Final norm and (reduced) output head: [rows, hidden] -> fp32 [rows, vocab], -inf at
        ids outside vocab_ids."""
        x, rows = self.norm(g), self.head_rows()
        if self.vocab_ids is None:
            return nn.functional.linear(x, rows).float()
        if self._packed is not None and self._packed.holds(rows, None):
            part = self._packed(x).float()  # [rows, K]
        else:
            part = nn.functional.linear(x, rows).float()
        out = part.new_full((x.shape[0], self.target[0].vocab_size), float("-inf"))
        return out.index_copy_(1, self.vocab_ids.to(out.device), part)

    @torch.no_grad()
    def forward(
        self,
        batch: SeqBatch,
        hidden: torch.Tensor,
        kv: KVPool,
        last_only: bool,
        before_layer: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits fp32 [T or num_seqs, vocab], g [T, hidden]) for entries batch.positions with
        target states `hidden` [T, hidden] (row i: h at position positions[i] - 1; zeros for position 0).
        `before_layer(0)` runs before the head's one layer reads its KV (pending loads)."""
        target = self.target[0]
        if before_layer is not None:
            before_layer(0)
        capacity, page_size = kv.k(0).shape[:2]
        batch.validate(page_size, capacity)
        meta = build_meta(
            batch.positions, batch.seq_lens, batch.ctx_lens, batch.page_tables, page_size
        )
        x = self.entry_input(batch.input_ids, hidden)  # [T, hidden]
        rope = target.rotary.tables(batch.positions, x.dtype)
        g = self.layer(x, rope, kv.k(0), kv.v(0), meta)  # [T, hidden]
        y = g
        if last_only:
            y = g[torch.tensor(batch.seq_lens).cumsum(0) - 1]  # [num_seqs, hidden]
        return self.logits(y), g


def is_head_draft(spec_draft: str) -> bool:
    """The draft is an MTPHead (mtp:... or nextn), not a draft model."""
    return spec_draft.startswith(MTP_PREFIX) or spec_draft == NEXTN


def _fingerprint(head: MTPHead) -> str:
    h = xxhash.xxh3_128()
    h.update(head.KIND.encode())  # a subclass computes other outputs from the same names
    for name, tensor in sorted(head.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _randomize(head: MTPHead) -> None:
    """Normal(0, 0.02) matrices, unit norms, from RANDOM_SEED (transformers' init scale)."""
    gen = torch.Generator().manual_seed(RANDOM_SEED)
    for _, param in sorted(head.named_parameters()):
        if param.dim() == 2:
            param.copy_(torch.randn(param.shape, generator=gen).to(param.dtype) * 0.02)


def save_head(head: MTPHead, path: Path) -> None:
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(path))


def load_head_file(path: Path, target: DecoderLM, name: str) -> MTPHead:
    """The head saved at `path` (a safetensors file of MTPHead's names); `name` (the
    --spec-draft) in errors."""
    if not path.is_file():
        raise ValueError(f"spec_draft {name!r}: {path} is not a safetensors file")
    head = MTPHead(target)
    state = load_file(str(path))
    if VOCAB_IDS in state:
        head.set_vocab(state[VOCAB_IDS])
    want = head.state_dict()
    bad = {k for k in want if k not in state or state[k].shape != want[k].shape}
    if bad or set(state) - set(want):
        raise ValueError(f"spec_draft {name!r}: not an MTP head of this target's shape")
    head.load_state_dict({k: v.to(want[k].dtype) for k, v in state.items()})
    return place_head(head, target)


def place_head(head: MTPHead, target: DecoderLM) -> MTPHead:
    """The head on the target's device, fingerprinted, its layer fused (and prepacked) as the
    target's layers are: unfused, its seven small matmuls cost a draft pass several target
    layers' time."""
    head.to(target.model.embed_tokens.weight.device)
    head.fingerprint = _fingerprint(head)  # over the plain weights, before any packing
    prepack = target.head_packed is not None  # the target's linears are in oneDNN's layout
    head.layer.self_attn.fuse(prepack)
    head.layer.mlp.fuse(prepack)
    head.head_rows()  # a reduced head's rows (and their packed layout) once, outside inference mode
    return head


def load_head(spec_draft: str, target: DecoderLM) -> MTPHead:
    """The head named by `mtp:random` or `mtp:PATH` (a safetensors file of MTPHead's names)."""
    what = spec_draft[len(MTP_PREFIX) :]
    if what != RANDOM:
        return load_head_file(Path(what), target, spec_draft)
    head = MTPHead(target)
    _randomize(head)
    return place_head(head, target)

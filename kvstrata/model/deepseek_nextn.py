"""A checkpoint's own NextN (MTP) layer, as DeepSeek-V3 checkpoints store it, as the draft.

DeepSeek-V3 (and checkpoints of its layout: `num_nextn_predict_layers` > 0 in config.json) keeps
NextN layer k as decoder layer index `num_hidden_layers + k` of its own weights:
    model.layers.{N}.embed_tokens.weight              [vocab, hidden]  (a copy of the target's)
    model.layers.{N}.enorm.weight, .hnorm.weight      [hidden]
    model.layers.{N}.eh_proj.weight                   [hidden, 2 * hidden]  (embedding, state)
    model.layers.{N}.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}
        the decoder block the target would have at index N (MLA attention; MoE for N past
        first_k_dense_replace)
    model.layers.{N}.shared_head.norm.weight          [hidden]
    model.layers.{N}.shared_head.head.weight          [vocab, hidden]  (a copy of lm_head)
The layer reads the target's hidden state after its final norm (the state serving engines pass
to DeepSeek's MTP modules), so entry j here takes norm(h_{j-1}) with h the pre-norm state the
engine and the pages keep (kvstrata.model.page_state): the same values, normed on the way in.

DeepSeek's MTP sequence for a prompt t_0 .. t_{T-1} is the entries (t_j, h_{j-1}) for j >= 1:
nothing stands for t_0. The speculator (MTPHead's) also runs an entry 0 (t_0, a zero state);
here its latent row is written but hidden from every later entry (MLAttention.hide_first), so
entries j >= 1 see exactly the module's sequence; entry 0 itself attends to itself alone (its
output only drafts after a one-token prompt).

Only the first NextN layer (k = 0) is read: the draft chains it for every proposal, as MTPHead
does. Embedding and output-head copies equal to the target's are shared, not held twice; a copy
that differs is kept and used. The speculator, page states, tiers and transfers are MTPHead's
(kvstrata.engine.mtp_speculator): this module only supplies the layer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvstrata.model.checkpoint import read_config, weight_files
from kvstrata.model.decoder import DecoderLM
from kvstrata.model.mla_attention import MLAttention
from kvstrata.model.mtp import NEXTN, MTPHead, place_head

NEXTN_LAYERS = "num_nextn_predict_layers"
_RENAMED = {"shared_head.norm.weight": "norm.weight", "shared_head.head.weight": "head.weight"}
_OWN = ("enorm.", "hnorm.", "eh_proj.", "embed_tokens.", "shared_head.")


class DeepSeekNextN(MTPHead):
    """MTPHead over a checkpoint's NextN layer: the target's final norm on the incoming state,
    and the layer's own embedding / output head where its copies differ from the target's."""

    KIND = "deepseek-nextn"

    def __init__(self, target: DecoderLM) -> None:
        super().__init__(target)
        attn = self.layer.self_attn
        if not isinstance(attn, MLAttention):
            raise ValueError(
                f"spec_draft {NEXTN}: NextN layers in the checkpoint's weights are read for "
                "MLA (DeepseekV3) targets only"
            )
        attn.hide_first = True  # entry 0 is not part of the MTP sequence (module doc)
        self.embed_tokens: nn.Embedding | None = None  # None: the target's (equal copy)
        self.head: nn.Linear | None = None  # None: the target's output head (equal copy)

    def out_weight(self) -> torch.Tensor:
        return super().out_weight() if self.head is None else self.head.weight

    def entry_input(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """x_j = eh_proj([enorm(embed(t_j)); hnorm(norm(h_{j-1}))]) [T, hidden]: h before the
        target's final norm in, normed here (zeros stay zeros: entry 0's state)."""
        target = self.target[0]
        embed = target.model.embed_tokens if self.embed_tokens is None else self.embed_tokens
        emb = embed(input_ids)  # [T, hidden]
        state = self.hnorm(target.model.norm(hidden.to(emb.dtype)))
        return self.eh_proj(torch.cat([self.enorm(emb), state], dim=-1))


def has_nextn_layers(model_dir: Path | None) -> bool:
    """The checkpoint at `model_dir` declares NextN layers in its own weights."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return False
    return int(read_config(model_dir).get(NEXTN_LAYERS) or 0) > 0


def _read_layer(model_dir: Path, index: int) -> dict[str, torch.Tensor]:
    """The weights `model.layers.{index}.*` of the checkpoint, their prefix removed."""
    prefix = f"model.layers.{index}."
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if key.startswith(prefix):
                    out[key[len(prefix) :]] = f.get_tensor(key)
    if not out:
        raise ValueError(
            f"spec_draft nextn: {model_dir} declares {NEXTN_LAYERS} but holds no "
            f"model.layers.{index}.* weights"
        )
    return out


def _head_names(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> DeepSeekNextN's (the decoder block under `layer.`)."""
    out = {}
    for name, tensor in raw.items():
        if name in _RENAMED:
            out[_RENAMED[name]] = tensor
        elif name.startswith(_OWN):
            out[name] = tensor
        else:
            out[f"layer.{name}"] = tensor
    return out


def _share_copies(head: DeepSeekNextN, state: dict[str, torch.Tensor]) -> None:
    """Drop embedding / output-head copies equal to the target's; keep a differing one."""
    target = head.target[0]
    for name, shared in (
        ("embed_tokens.weight", target.model.embed_tokens.weight),
        ("head.weight", MTPHead.out_weight(head)),
    ):
        own = state.pop(name, None)
        if own is None or torch.equal(own.to(shared.dtype), shared.detach().cpu()):
            continue
        vocab, hidden = own.shape
        dtype = shared.dtype
        if name == "head.weight":
            head.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype).requires_grad_(False)
        else:
            head.embed_tokens = nn.Embedding(vocab, hidden, dtype=dtype).requires_grad_(False)
        state[name] = own


def load_deepseek_nextn(target: DecoderLM, model_dir: Path) -> DeepSeekNextN:
    """The first NextN layer of the checkpoint at `model_dir` (DeepSeek-V3's layout, module
    doc) as a draft head of `target`; ValueError naming what does not match."""
    layers = int(read_config(model_dir)["num_hidden_layers"])
    head = DeepSeekNextN(target)
    state = _head_names(_read_layer(Path(model_dir), layers))
    _share_copies(head, state)
    want = head.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    wrong = sorted(k for k in set(want) & set(state) if want[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"spec_draft {NEXTN}: model.layers.{layers}.* of {model_dir} is not a NextN layer "
            f"of this target: missing {missing[:4]}, unexpected {unexpected[:4]}, "
            f"other shape {wrong[:4]}"
        )
    head.load_state_dict({k: v.to(want[k].dtype) for k, v in state.items()})
    return place_head(head, target)

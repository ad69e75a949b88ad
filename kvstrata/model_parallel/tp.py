"""Tensor parallel: shard a loaded DecoderLM's heads and MLP columns across the tp group.

Rank r of tp keeps query heads [r*H/tp, (r+1)*H/tp), the K/V heads they use (GQA groups stay
whole: kv heads [r*K/tp, (r+1)*K/tp)) and MLP columns [r*I/tp, (r+1)*I/tp). o_proj and
down_proj become row-parallel: each rank multiplies its slice, then one all_reduce(SUM) over the
tp group rebuilds the full hidden state (their biases are added once, by tp rank 0). Embeddings,
norms and the LM head are replicated. The sharded model is an ordinary DecoderLM whose spec has
the local head counts, so its kv_shape() (and the rank's device and host pools) hold only this
rank's heads of every page; its fingerprint is the full model's, so page keys (and storage) are
the same under any tp.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvstrata.model.decoder import DecoderLM, ModelSpec
from kvstrata.model.deepseek import MLADecoderLM, MLASpec


class AllReduceOut(nn.Module):
    """A row-parallel linear: local partial product, then all_reduce(SUM) over the group."""

    def __init__(self, linear: nn.Module, group: Any) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_local] -> [T, out]
        y = self.linear(x)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y


def head_range(num_heads: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """[first, end) of the heads tp rank `tp_rank` holds (num_heads must divide by tp)."""
    if num_heads % tp:
        raise ValueError(f"tp={tp} must divide the number of heads ({num_heads})")
    per = num_heads // tp
    return tp_rank * per, (tp_rank + 1) * per


def check_layout(spec: ModelSpec, tp: int, pp: int) -> None:
    """ValueError, before any rank starts, for a layout this model cannot be split into."""
    sizes = [("query heads", spec.num_heads), ("MLP width", spec.intermediate_size)]
    if isinstance(spec, MLASpec):  # every rank holds the whole latent: no K/V head to divide
        assert spec.moe is not None
        sizes.append(("MoE expert width", spec.moe.expert_size))
    else:
        sizes.append(("K/V heads", spec.num_kv_heads))
    for what, n in sizes:
        if n % tp:
            raise ValueError(f"--tp {tp} must divide the model's {what} ({n})")
    if not 1 <= pp <= spec.num_layers:
        raise ValueError(f"--pp {pp} must be in [1, {spec.num_layers}] (the model's layers)")


def _sliced_state(model: DecoderLM, tp: int, r: int) -> dict[str, torch.Tensor]:
    """The full state dict with every sharded weight cut to rank r's slice."""
    s = model.spec
    q0, q1 = (x * s.head_dim for x in head_range(s.num_heads, tp, r))
    k0, k1 = (x * s.head_dim for x in head_range(s.num_kv_heads, tp, r))
    i0, i1 = head_range(s.intermediate_size, tp, r)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if ".q_proj." in name:
            t = t[q0:q1]
        elif ".k_proj." in name or ".v_proj." in name:
            t = t[k0:k1]
        elif ".gate_proj." in name or ".up_proj." in name:
            t = t[i0:i1]
        elif name.endswith("o_proj.weight"):
            t = t[:, q0:q1]
        elif name.endswith("down_proj.weight"):
            t = t[:, i0:i1]
        elif name.endswith(("o_proj.bias", "down_proj.bias")) and r != 0:
            t = torch.zeros_like(t)  # the sum over ranks adds the bias once
        out[name] = t.clone()
    return out


def shard_tp(model: DecoderLM, tp: int, tp_rank: int, group: Any = None) -> DecoderLM:
    """A DecoderLM holding tp rank `tp_rank`'s slice of `model` (which is left untouched)."""
    if tp < 1 or not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank must be in [0, tp={tp}), got {tp_rank}")
    if tp == 1:
        return model
    if isinstance(model, MLADecoderLM):
        return shard_mla(model, tp, tp_rank, group)
    s = model.spec
    head_range(s.num_heads, tp, 0)  # divisibility checks, each naming its field
    head_range(s.num_kv_heads, tp, 0)
    head_range(s.intermediate_size, tp, 0)
    local_spec = dataclasses.replace(
        s,
        num_heads=s.num_heads // tp,
        num_kv_heads=s.num_kv_heads // tp,
        intermediate_size=s.intermediate_size // tp,
    )
    local = DecoderLM(local_spec, model.dtype_name)
    device = model.model.embed_tokens.weight.device
    local.to(device)
    local.load_state_dict(_sliced_state(model, tp, tp_rank))
    for layer in local.model.layers:
        layer.self_attn.o_proj = AllReduceOut(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = AllReduceOut(layer.mlp.down_proj, group)
    local.fingerprint = model.fingerprint  # same weights, same page keys as the full model
    return local.fuse()  # the local slices: q/k/v and gate/up of this rank in one matmul each


def shard_mla(model: MLADecoderLM, tp: int, r: int, group: Any = None) -> MLADecoderLM:
    """Rank r's slice of a latent-attention model: its query heads (q_b_proj / q_proj rows,
    kv_b_proj rows, o_proj columns) and 1/tp of every MLP and expert's width; the latent
    projections (q_a, kv_a), norms, router, embeddings and head are replicated, so every rank
    computes and holds the same latent rows (the whole page). o_proj, the dense down_proj and a
    whole MoE block (its experts' and shared experts' partial products) end in all_reduce."""
    s = model.spec
    check_layout(s, tp, 1)
    assert s.mla is not None and s.moe is not None
    heads = s.num_heads // tp
    local_spec = dataclasses.replace(
        s,
        num_heads=heads,
        intermediate_size=s.intermediate_size // tp,
        mla=dataclasses.replace(s.mla, heads=heads),
        moe=dataclasses.replace(s.moe, expert_size=s.moe.expert_size // tp),
    )
    local = MLADecoderLM(local_spec, model.dtype_name)
    local.to(model.model.embed_tokens.weight.device)
    local.load_state_dict(_mla_sliced_state(model, tp, r))
    local.fuse(prepack=False)  # gate/up fused before the wrappers below replace modules
    for i, layer in enumerate(local.model.layers):
        layer.self_attn.o_proj = AllReduceOut(layer.self_attn.o_proj, group)
        if i < s.first_dense:
            layer.mlp.down_proj = AllReduceOut(layer.mlp.down_proj, group)
        else:
            layer.mlp = AllReduceOut(layer.mlp, group)
    local.fingerprint = model.fingerprint  # same weights, same page keys as the full model
    return local


def _mla_sliced_state(model: MLADecoderLM, tp: int, r: int) -> dict[str, torch.Tensor]:
    """The full state dict with every sharded weight cut to rank r's slice."""
    d = model.spec.mla
    assert d is not None
    h0, h1 = head_range(d.heads, tp, r)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith(("q_b_proj.weight", "self_attn.q_proj.weight")):
            t = t[h0 * d.qk_dim : h1 * d.qk_dim]
        elif name.endswith("kv_b_proj.weight"):
            t = t[h0 * (d.nope_dim + d.v_dim) : h1 * (d.nope_dim + d.v_dim)]
        elif name.endswith("o_proj.weight"):
            t = t[:, h0 * d.v_dim : h1 * d.v_dim]
        elif name.endswith("o_proj.bias") and r != 0:
            t = torch.zeros_like(t)  # the sum over ranks adds the bias once
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            t = t.chunk(tp, dim=0)[r]  # dense MLP, routed and shared experts alike
        elif name.endswith("down_proj.weight"):
            t = t.chunk(tp, dim=1)[r]
        out[name] = t.clone()
    return out

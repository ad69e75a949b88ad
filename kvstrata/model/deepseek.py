"""DeepSeek-V3 decoder (DeepseekV3ForCausalLM) over latent pages: MLA attention in every layer,
a dense SwiGLU MLP in the first `first_k_dense_replace` layers and a mixture of experts after.

It is a DecoderLM (same forward, batch, pruning and LM head); only its layers, rotary tables and
page shape differ. Parameter names equal the checkpoint's, so a state dict loads as is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvstrata.memory.layout import KVShape
from kvstrata.model.decoder import DecoderLayer, DecoderLM, ModelSpec
from kvstrata.model.layers import Rotary, SwiGLU, softmax_mscale
from kvstrata.model.mla_attention import MLADims, MLAttention
from kvstrata.model.moe import MoE, MoESpec


@dataclass(frozen=True)
class MLASpec(ModelSpec):
    """A ModelSpec whose layers use latent attention. Its num_kv_heads (1) and head_dim (D/2)
    describe the latent page (memory/layout.py), not attention heads."""

    mla: MLADims | None = None
    """The attention block's sizes."""
    moe: MoESpec | None = None
    """The MoE layers' routing and sizes."""
    first_dense: int = 0
    """first_k_dense_replace: layers before this index use the dense MLP, later ones MoE."""


class MLADecoderLM(DecoderLM):
    """DeepseekV3ForCausalLM over latent pages; inference only."""

    spec: MLASpec

    def make_layer(self, index: int, dtype: torch.dtype) -> nn.Module:
        """The pre-norm block over latent attention, with a dense MLP before `first_dense` and
        MoE after."""
        s = self.spec
        assert s.mla is not None and s.moe is not None
        mlp: nn.Module
        if index < s.first_dense:
            mlp = SwiGLU(s.hidden_size, s.intermediate_size, False, dtype)
        else:
            mlp = MoE(s.hidden_size, s.moe, dtype)
        return DecoderLayer(s, dtype, MLAttention(s.mla, dtype), mlp)

    def make_rotary(self) -> Rotary:
        s = self.spec
        assert s.mla is not None
        return Rotary(s.mla.rope_dim, s.rope_theta, s.rope_scaling)

    def kv_shape(self, page_size: int, dtype: str | None = None) -> KVShape:
        """Latent pages: one row [kv_lora_rank + qk_rope_head_dim] per token per layer."""
        s = self.spec
        assert s.mla is not None
        return KVShape.latent(s.num_layers, s.mla.row, page_size, dtype or self.dtype_name)


def parse_deepseek_spec(cfg: dict[str, Any], base: ModelSpec) -> MLASpec:
    """MLASpec from a DeepseekV3 config.json dict and the fields every decoder shares."""
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"unsupported scoring_func {cfg.get('scoring_func')!r}; only sigmoid")
    heads, rope = int(cfg["num_attention_heads"]), int(cfg["qk_rope_head_dim"])
    nope, kv_rank = int(cfg["qk_nope_head_dim"]), int(cfg["kv_lora_rank"])
    q_rank = cfg.get("q_lora_rank")
    mla = MLADims(
        hidden=base.hidden_size,
        heads=heads,
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=kv_rank,
        nope_dim=nope,
        rope_dim=rope,
        v_dim=int(cfg["v_head_dim"]),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        scaling=(nope + rope) ** -0.5 * softmax_mscale(base.rope_scaling),
    )
    if mla.row % 2:
        raise ValueError(f"kv_lora_rank + qk_rope_head_dim = {mla.row} must be even")
    moe = MoESpec(
        num_experts=int(cfg["n_routed_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        num_groups=int(cfg.get("n_group") or 1),
        top_groups=int(cfg.get("topk_group") or 1),
        scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        normalize=bool(cfg.get("norm_topk_prob", True)),
        expert_size=int(cfg["moe_intermediate_size"]),
        shared_experts=int(cfg.get("n_shared_experts") or 0),
    )
    shared = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelSpec)}
    shared.update(num_kv_heads=1, head_dim=mla.row // 2)  # the latent page's geometry
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return MLASpec(**shared, mla=mla, moe=moe, first_dense=first_dense)

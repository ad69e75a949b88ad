"""DeepSeek-V3 mixture of experts: a sigmoid router with group-limited top-k, routed SwiGLU
experts and always-on shared experts, computed as transformers' DeepseekV3MoE computes them.

Parameter names equal the checkpoint's (mlp.gate.weight, mlp.gate.e_score_correction_bias,
mlp.experts.E.{gate,up,down}_proj.weight, mlp.shared_experts.*), so a state dict loads as is.
The router runs in fp32 whatever the model dtype (its weights are kept fp32 by the loader).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvstrata.model.layers import SwiGLU


@dataclass(frozen=True)
class MoESpec:
    """Routing hyper-parameters of the MoE layers (config.json names in the docs)."""

    num_experts: int
    """n_routed_experts: experts a token may be routed to."""
    top_k: int
    """num_experts_per_tok: experts each token runs."""
    num_groups: int
    """n_group: experts are split into this many equal groups."""
    top_groups: int
    """topk_group: a token picks its experts only from its best groups."""
    scaling: float
    """routed_scaling_factor: multiplies the routed experts' weights."""
    normalize: bool
    """norm_topk_prob: the chosen experts' weights are normalised to sum to 1 first."""
    expert_size: int
    """moe_intermediate_size: each expert's SwiGLU width."""
    shared_experts: int
    """n_shared_experts: the shared MLP is this many experts wide."""


class Router(nn.Module):
    """Sigmoid scores; experts chosen by score + correction bias within the top groups."""

    def __init__(self, hidden: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] fp32, expert ids [T, top_k]) of x [T, hidden]."""
        s = self.spec
        scores = nn.functional.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.view(-1, s.num_groups, s.num_experts // s.num_groups)
        group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
        best = group_scores.topk(s.top_groups, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()  # [T, groups]
        allowed = allowed[:, :, None].expand_as(per_group).reshape(-1, s.num_experts)
        ids = choice.masked_fill(~allowed, float("-inf")).topk(s.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if s.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.scaling, ids


class MoE(nn.Module):
    """shared_experts(x) + sum over each token's routed experts of weight * expert(x)."""

    def __init__(self, hidden: int, spec: MoESpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = Router(hidden, spec)
        self.experts = nn.ModuleList(
            SwiGLU(hidden, spec.expert_size, False, dtype) for _ in range(spec.num_experts)
        )
        width = spec.expert_size * spec.shared_experts
        self.shared_experts = SwiGLU(hidden, width, False, dtype)

    def fuse(self, prepack: bool = False) -> None:
        """gate and up of every expert as one matmul (see SwiGLU.fuse)."""
        for expert in self.experts:
            expert.fuse(prepack)
        self.shared_experts.fuse(prepack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        weights, ids = self.gate(x)  # [T, top_k] each
        out = torch.zeros_like(x)
        # experts in ascending order, each over the tokens routed to it (transformers' order)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            y = self.experts[e](x[token]) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out + self.shared_experts(x)

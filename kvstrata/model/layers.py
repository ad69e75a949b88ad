"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, SwiGLU MLP.

Each block mirrors the Hugging Face implementation's arithmetic (fp32 normalisation, fp32
rotary tables) so logits match transformers' own forward to float tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from kvstrata.model import small_matmul, step_ops
from kvstrata.model.prepack import (
    EDITED,
    PackOwner,
    Prepacked,
    is_placeholder,
    pack_linear,
    plain_linear,
    refuse_released,
)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in fp32 whatever the model dtype."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if x.dtype == self.weight.dtype and step_ops.fits(x, self.weight):
            return step_ops.rms_norm(x, self.weight, self.eps)[1]  # one pass, same arithmetic
        if x.dtype == self.weight.dtype == torch.float32:
            # fp32: the same arithmetic in one kernel, not 6 ops (equal here to the last bit;
            # per call not slower at 2048 tokens and faster at 1-64, measured on 2 cores)
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # bf16: normalised in fp32 by the same one kernel (x * rsqrt(mean(x^2) + eps)), the
        # weight applied after rounding back, as transformers does; 3 ops instead of 7
        h = nn.functional.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps)
        return self.weight * h.to(x.dtype)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, norm(x + h)), the sum a new tensor (x is not written): a residual add and the
        next norm in one native pass where it runs (x, h [T, hidden])."""
        if x.dtype == h.dtype == self.weight.dtype and step_ops.fits(x, h, self.weight):
            return step_ops.rms_norm(x, self.weight, self.eps, residual=h)
        s = x + h
        return s, self(s)


class Fused:
    """Linears that read the same input, as one matmul: their weights are rows of one tensor.

    Building it makes each part's weight (and bias) a view into the fused tensor, so the parts
    keep their Hugging Face names in the state dict, an in-place load (`copy_`) updates both,
    and no weight is held twice. Prepacked, the fused tensor is released (model/prepack.py):
    the parts' weights are views of its placeholder, and `unpack` derives the plain tensor
    back. Not a module: the fused tensor is no extra state-dict entry.
    Invariant checked by `holds()` before every use: each part still holds exactly its view. A
    part whose weight was replaced afterwards (load_state_dict(assign=True), a new Parameter,
    a move to another device) makes the caller fall back to the separate parts, never to stale
    weights.
    """

    @classmethod
    def build(cls, parts: Sequence[nn.Linear], prepack: bool = False) -> Fused | None:
        """The parts fused (and prepacked: see model/prepack.py); None (use them as they are)
        if only some have a bias."""
        with_bias = {p.bias is not None for p in parts}
        return cls(parts, prepack) if len(with_bias) == 1 else None

    def __init__(self, parts: Sequence[nn.Linear], prepack: bool = False) -> None:
        weight = torch.cat([p.weight.detach() for p in parts])  # [sum(out), in]
        biases = [p.bias for p in parts]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("Fused: all parts need a bias, or none")
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self._guards: list[Any] = []  # the parts' forward pre-hooks while released
        ends = torch.tensor([p.out_features for p in parts]).cumsum(0).tolist()
        self.rows = [slice(a, b) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        # an in-place load into a part bumps the fused tensor's version too (views share it)
        self.packed = Prepacked.build(weight, self.bias) if prepack else None
        if self.packed is not None:
            weight = self.packed.release()  # the packed copy is the only one
        self._bind(parts, weight)

    def _bind(self, parts: Sequence[nn.Module], weight: torch.Tensor) -> None:
        """Each part's weight (and bias) becomes its rows of `weight` (and of the fused bias);
        parts of a placeholder refuse a direct call (prepack.refuse_released)."""
        self.weight = weight
        for p, rows in zip(parts, self.rows, strict=True):
            p.weight = nn.Parameter(weight[rows], requires_grad=False)
            if self.bias is not None:
                p.bias = nn.Parameter(self.bias[rows], requires_grad=False)
        self._views = [(p.weight, p.weight.data_ptr(), p.bias, _address(p.bias)) for p in parts]
        if is_placeholder(weight):
            self._guards = [p.register_forward_pre_hook(refuse_released) for p in parts]

    def holds(self, parts: Sequence[nn.Module]) -> bool:
        """True if `parts` are still the fused linears, each holding its view (a few us)."""
        if len(parts) != len(self._views):
            return False
        for part, (weight, w_at, bias, b_at) in zip(parts, self._views, strict=True):
            w, b = getattr(part, "weight", None), getattr(part, "bias", 0)
            if w is not weight or b is not bias or w.data_ptr() != w_at or _address(b) != b_at:
                return False
        return True

    def dense_parts(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The released parts' plain weights (rows of one re-derived tensor), by state-dict
        name (`names`: the parts' attribute names); empty unless released."""
        if self.packed is None or not self.packed.released:
            return {}
        dense = self.packed.dense()
        return {f"{n}.weight": dense[r] for n, r in zip(names, self.rows, strict=True)}

    def unpack(self, parts: Sequence[nn.Module]) -> None:
        """The plain fused tensor back (re-derived) and the packed copy dropped: parts still
        holding their placeholder views get views of it; a replaced part keeps its own."""
        packed, self.packed = self.packed, None
        if packed is None or not packed.released:
            return
        for guard in self._guards:
            guard.remove()
        dense = packed.dense()
        if self.holds(parts):
            self._bind(parts, dense)
            return
        self.weight = dense  # a part was replaced: the caller runs the parts from now on
        for p, rows, (view, *_) in zip(parts, self.rows, self._views, strict=True):
            if getattr(p, "weight", None) is view:
                p.weight = nn.Parameter(dense[rows], requires_grad=False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(out)]
        packed = self.packed
        if packed is not None and packed.holds(self.weight, self.bias):
            return packed(x)
        if is_placeholder(self.weight):
            raise RuntimeError(EDITED)
        return small_matmul.linear(x, self.weight, self.bias)  # few rows: the native kernel


def _address(t: torch.Tensor | None) -> int:
    return -1 if t is None else t.data_ptr()


class SwiGLU(PackOwner):
    """down(silu(gate(x)) * up(x)), the Llama/Qwen2 MLP."""

    def __init__(self, hidden: int, inter: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=bias, dtype=dtype)
        self.fused: Fused | None = None  # gate and up in one matmul, once fuse() ran

    def fuse(self, prepack: bool = False) -> None:
        """gate_proj and up_proj as one matmul (see Fused); `prepack`: oneDNN layouts too (the
        plain weights released)."""
        self.unpack()
        self.fused = Fused.build([self.gate_proj, self.up_proj], prepack)
        if prepack:
            self.down_proj = pack_linear(self.down_proj)

    def dense_weights(self) -> dict[str, torch.Tensor]:
        return {} if self.fused is None else self.fused.dense_parts(("gate_proj", "up_proj"))

    def unpack(self) -> None:
        if self.fused is not None:
            self.fused.unpack([self.gate_proj, self.up_proj])
        self.down_proj = plain_linear(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        f = self.fused
        if f is not None and f.holds([self.gate_proj, self.up_proj]):
            gate, up = f(x).chunk(2, dim=-1)  # [T, inter] each (views)
        else:
            if f is not None:  # a part was replaced: the other's plain weight back
                f.unpack([self.gate_proj, self.up_proj])
            gate, up = small_matmul.run(self.gate_proj, x), small_matmul.run(self.up_proj, x)
        # silu into a new dense tensor, then the product in place: gate and up are column
        # halves of one output (strided), and down_proj would otherwise copy them dense
        act = nn.functional.silu(gate).mul_(up)  # [T, inter] contiguous
        return small_matmul.run(self.down_proj, act)  # a PackedLinear once prepacked


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exps)  # [head_dim / 2]


def _default(head_dim: int, theta: float, _: Mapping[str, Any]) -> torch.Tensor:
    return _base_inv_freq(head_dim, theta)


def _linear(head_dim: int, theta: float, p: Mapping[str, Any]) -> torch.Tensor:
    # Scaling the positions by 1/factor is the same as scaling the frequencies.
    return _base_inv_freq(head_dim, theta) / float(p["factor"])


def _llama3(head_dim: int, theta: float, p: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: low frequencies divided by `factor`, high ones kept, smooth between."""
    inv = _base_inv_freq(head_dim, theta)
    factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, theta: float, p: Mapping[str, Any]) -> torch.Tensor:
    """YaRN: frequencies above the correction range kept (extrapolated), below it divided by
    `factor` (interpolated), a linear ramp between (dimension bounds from beta_fast/slow)."""
    factor, old_ctx = float(p["factor"]), float(p["original_max_position_embeddings"])
    fast, slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = _base_inv_freq(head_dim, theta)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return base / factor * (1 - keep) + base * keep


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """The factor a rope type multiplies cos and sin by (YaRN's attention temperature; 1.0 for
    the others)."""
    p = scaling or {}
    if p.get("rope_type") != "yarn":
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor, mscale, all_dim = float(p["factor"]), p.get("mscale"), p.get("mscale_all_dim")
    if mscale and all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))
    return _yarn_mscale(factor)


def softmax_mscale(scaling: Mapping[str, Any] | None) -> float:
    """DeepSeek's extra softmax scale under a scaled rope: mscale(factor, mscale_all_dim)^2
    (1.0 without scaling or without mscale_all_dim)."""
    p = scaling or {}
    all_dim = p.get("mscale_all_dim")
    if p.get("rope_type", "default") == "default" or not all_dim:
        return 1.0
    return _yarn_mscale(float(p["factor"]), float(all_dim)) ** 2


ROPE_TYPES: dict[str, Callable[[int, float, Mapping[str, Any]], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}
"""Supported rope types. "dynamic" NTK is deliberately absent: its frequencies depend on the
longest sequence in the current forward, so a position's K would differ between a one-shot
prefill and a chunked or cached one, which breaks prefix caching."""


class Rotary(nn.Module):
    """Rotary position embedding with the checkpoint's theta and scaling; rotate-half layout."""

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> None:
        super().__init__()
        rope_type = str((scaling or {}).get("rope_type", "default"))
        fn = ROPE_TYPES.get(rope_type)
        if fn is None:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        self.register_buffer("inv_freq", fn(head_dim, theta, scaling or {}), persistent=False)
        self.attention_factor = rope_attention_factor(scaling)  # scales cos and sin

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables for absolute `positions` [T] -> two [T, head_dim] tensors."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (
                emb.sin() * self.attention_factor
            ).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the per-token tables cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, dim] whose rotary dims come in pairs (x0, x1), (x2, x3), ...
    (DeepSeek's `rope_interleave`): out = [even * cos - odd * sin | odd * cos + even * sin],
    the pairs de-interleaved as transformers lays them out (cos/sin [T, dim], halves equal)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)

"""Linear weights prepacked in oneDNN's blocked layout for CPU fp32 matmuls.

`F.linear` on CPU re-reads the plain [out, in] weight for every call; oneDNN's linear with a
weight reordered once into its own blocked layout measured, on 2 cores with SmolLM2's shapes,
0.84-0.92 of F.linear's time at 2048 rows (prefill) and 0.21-0.49 at 4 rows (batched decode);
logits stay within float tolerance of transformers' forward (`EngineConfig.prepack_weights`).

The packed weight is the only copy: once packed, the plain weight is released (`release`) and
the module holds a placeholder of the same shape and dtype on the meta device (no storage). A
linear packed alone becomes a `PackedLinear` (its own forward runs the packed weight, so a
direct call works); the parts of a fused matmul (layers.Fused) hold placeholder views and
refuse a direct call with a clear error (an nn.Linear over a meta weight would silently read
garbage). The plain weight is re-derived from the packed one, bit-exactly (`dense`), where it
is needed: the state dict (hooks), a load into the module or a move (`PackOwner.unpack`
first), a fallback to the separate parts. SmolLM2's model RSS, plain 619 MiB, was 1,379 MiB
when both copies were kept; 744 MiB now (the LM head keeps its plain weight: it is the tied
embedding there, and other code reads an untied head's weight directly).

Invariant: a Prepacked is used only while its source weight is unchanged — the same tensor
(the placeholder once released), storage and version counter (an in-place `copy_` bumps it) —
and the same bias; otherwise the caller runs the plain module, never stale weights (and a
released weight edited in place is an error: its plain values are gone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def can_prepack(weight: torch.Tensor) -> bool:
    """CPU fp32 weights outside inference mode (they have a version counter), oneDNN built."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not weight.is_inference()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Prepacked:
    """y = x @ weight.T + bias through oneDNN, with `weight` reordered once (see module doc)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self._at = (weight.data_ptr(), weight._version, _version(bias))
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Prepacked | None:
        """A Prepacked of `weight`, or None where it cannot be used (see can_prepack)."""
        return cls(weight, bias) if can_prepack(weight) else None

    def release(self) -> nn.Parameter:
        """Drop the reference to the plain weight; returns the placeholder its owner puts in its
        place (which `holds` checks from now on). The plain storage is freed once the owner
        lets go of it too."""
        self.weight = placeholder(self.weight.shape, self.weight.dtype)
        self._at = (self.weight.data_ptr(), self.weight._version, _version(self.bias))
        return self.weight

    @property
    def released(self) -> bool:
        return is_placeholder(self.weight)

    def dense(self) -> torch.Tensor:
        """The plain weight [out, in], re-derived from the packed one (bit-exact; a new tensor)."""
        return self.packed.to_dense()

    def holds(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """True while `weight`/`bias` are still the tensors packed, unchanged (a few us)."""
        return (
            weight is self.weight
            and bias is self.bias
            and (weight.data_ptr(), weight._version, _version(bias)) == self._at
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _version(t: torch.Tensor | None) -> int:
    return -1 if t is None else t._version


def placeholder(shape: torch.Size, dtype: torch.dtype) -> nn.Parameter:
    """What a module holds where a released plain weight was: its shape and dtype, no storage."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


def is_placeholder(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "meta"


EDITED = (
    "a prepacked weight was edited in place; load weights with load_state_dict (it unpacks "
    "first) or call unpack() before editing them"
)


class PackedLinear(nn.Linear):
    """An nn.Linear whose weight lives only in oneDNN's layout (`packed`); `weight` is the
    placeholder, `bias` the plain one. Its state dict entry is the re-derived plain weight."""

    def __init__(self, linear: nn.Linear, packed: Prepacked) -> None:
        w = linear.weight
        super().__init__(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
        self.packed = packed
        self.weight = packed.release()
        self.bias = linear.bias  # the Parameter the packed linear holds
        self.register_state_dict_post_hook(_dense_own_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if not self.packed.holds(self.weight, self.bias):
            raise RuntimeError(EDITED)
        return self.packed(x)

    def unpacked(self) -> nn.Linear:
        """A plain nn.Linear of the same weights (re-derived) and the same bias Parameter."""
        w = self.weight
        plain = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
        plain.weight = nn.Parameter(self.packed.dense(), requires_grad=False)
        plain.bias = self.bias
        return plain


def _dense_own_weight(module: PackedLinear, state: dict[str, Any], prefix: str, _: Any) -> None:
    if is_placeholder(state.get(prefix + "weight")):
        state[prefix + "weight"] = module.packed.dense()


def pack_linear(linear: nn.Module) -> nn.Module:
    """A plain nn.Linear as a PackedLinear (its plain weight released) where it can be packed;
    anything else as it is."""
    if type(linear) is not nn.Linear:
        return linear
    packed = Prepacked.build(linear.weight, linear.bias)  # type: ignore[arg-type]
    return linear if packed is None else PackedLinear(linear, packed)  # type: ignore[arg-type]


def plain_linear(linear: nn.Module) -> nn.Module:
    """A PackedLinear back as a plain nn.Linear; anything else as it is."""
    return linear.unpacked() if isinstance(linear, PackedLinear) else linear


def refuse_released(module: nn.Module, _args: Any) -> None:
    """Forward pre-hook of a fused part holding a placeholder: its plain weight is gone."""
    if is_placeholder(getattr(module, "weight", None)):
        raise RuntimeError(
            "this linear's plain weight was released (prepacked, fused with others): run it "
            "through its owner or unpack() the owner first"
        )


class PackOwner(nn.Module):
    """A module whose fused linears may hold placeholders for released plain weights (see the
    module doc). Its state dict carries the re-derived plain weights under their usual names,
    and a load into it or a move of it unpacks first, so both see plain weights. Subclasses
    say which entries are released (`dense_weights`) and how to take them back (`unpack`)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_state_dict_post_hook(_dense_state)
        self.register_load_state_dict_pre_hook(_unpack_before_load)

    def dense_weights(self) -> dict[str, torch.Tensor]:
        """Plain weights re-derived for every released place, by state-dict name relative to
        this module (empty when nothing is released)."""
        raise NotImplementedError

    def unpack(self) -> None:
        """Plain weights back in every released place; the packed copies dropped."""
        raise NotImplementedError

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        self.unpack()  # a move or cast reads the plain weights (and packs are CPU fp32 only)
        return super()._apply(fn, recurse)


def _dense_state(module: PackOwner, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    for name, tensor in module.dense_weights().items():
        if is_placeholder(state.get(prefix + name)):
            state[prefix + name] = tensor


def _unpack_before_load(module: PackOwner, *_args: Any) -> None:
    module.unpack()

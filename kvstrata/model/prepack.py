"""Linear weights prepacked in oneDNN's blocked layout for CPU fp32 matmuls.

`F.linear` on CPU re-reads the plain [out, in] weight for every call; oneDNN's linear with a
weight reordered once into its own blocked layout measured, on 2 cores with SmolLM2's shapes,
0.84-0.92 of F.linear's time at 2048 rows (prefill) and 0.21-0.49 at 4 rows (batched decode);
logits stay within float tolerance of transformers' forward. The price is one more copy of each
packed weight in host memory (SmolLM2: model RSS 618 MiB plain, 1380 MiB packed), so it is a
choice (`EngineConfig.prepack_weights`).

Invariant: a Prepacked is used only while its source weight is unchanged — the same tensor,
storage and version counter (an in-place `copy_` bumps it) — and the same bias; otherwise the
caller runs the plain module, never stale weights.
"""

from __future__ import annotations

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


def prepack_module(linear: nn.Module) -> Prepacked | None:
    """A plain nn.Linear's weight packed; None for anything else (a tensor-parallel wrapper
    runs its own forward)."""
    if type(linear) is not nn.Linear:
        return None
    return Prepacked.build(linear.weight, linear.bias)


def run_linear(linear: nn.Module, packed: Prepacked | None, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)`, through `packed` while it still holds the module's weights."""
    weight, bias = getattr(linear, "weight", None), getattr(linear, "bias", None)
    if packed is not None and packed.holds(weight, bias):  # type: ignore[arg-type]
        return packed(x)
    return linear(x)

"""The shape of one model's paged KV cache, and the byte layouts of its pools and pages.

Device pool, layer-first:  [num_layers, 2, capacity, page_size, kv_heads, head_dim]
Host pool, page-first:     [capacity, num_layers, 2, page_size, kv_heads, head_dim]
One host page (all layers, K then V) is one contiguous block: exactly the canonical L3 page.

A single module below memory/ and storage/: both describe pages by it (memory/layout.py
re-exports it for the pools).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class KVShape:
    """The shape of one model's paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVShape.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            known = ", ".join(DTYPES)
            raise ValueError(f"KVShape.dtype must be one of {known}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def layer_page_numel(self) -> int:
        """Elements of K (or of V) of one page in one layer: page_size * kv_heads * head_dim."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_numel(self) -> int:
        """Elements of one page over all layers, K and V."""
        return self.num_layers * 2 * self.layer_page_numel

    @property
    def page_nbytes(self) -> int:
        return self.page_numel * self.itemsize

    def device_shape(self, capacity: int) -> tuple[int, ...]:
        """Layer-first pool shape [num_layers, 2, capacity, page_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, capacity, self.page_size, self.num_kv_heads, self.head_dim)

    def host_shape(self, capacity: int) -> tuple[int, ...]:
        """Page-first pool shape [capacity, num_layers, 2, page_size, kv_heads, head_dim]."""
        return (capacity, self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

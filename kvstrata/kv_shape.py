"""The shape of one model's paged KV cache, and the byte layouts of its pools and pages.

Device pool, layer-first:  [num_layers, 2, capacity, page_size, kv_heads, head_dim]
Host pool, page-first:     [capacity, num_layers, 2, page_size, kv_heads, head_dim]
One host page (all layers, K then V) is one contiguous block: exactly the canonical storage page.

Latent pages (layout "mla", multi-head latent attention): a token holds one row per layer, the
latent [kv_lora_rank] after kv_a_layernorm then the rotated RoPE key [qk_rope_head_dim], D values
in all (even); there is no K/V head. The row's first D/2 values sit in the K slot and the last
D/2 in the V slot of a one-"head" page (num_kv_heads=1, head_dim=D/2):
    device  [num_layers, 2, capacity, page_size, 1, D/2]
    host    [capacity, num_layers, 2, page_size, 1, D/2]
so every tier, copy, storage unit (one head: units are cut by layer range only) and transfer moves
latent pages unchanged, with no byte wasted; the tag keeps them apart from GQA pages.

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


KV_LAYOUTS = ("gqa", "mla")


@dataclass(frozen=True)
class KVShape:
    """The shape of one model's paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"
    layout: str = "gqa"
    """What a page holds: "gqa" K and V heads, "mla" one latent row per token (module doc)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVShape.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            known = ", ".join(DTYPES)
            raise ValueError(f"KVShape.dtype must be one of {known}, got {self.dtype!r}")
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"KVShape.layout must be one of {KV_LAYOUTS}, got {self.layout!r}")
        if self.layout == "mla" and self.num_kv_heads != 1:
            raise ValueError("KVShape: a latent (mla) page has one row per token, num_kv_heads 1")

    @classmethod
    def latent(cls, num_layers: int, row: int, page_size: int, dtype: str = "float32") -> KVShape:
        """The page of a latent-attention model whose per-token row has `row` values (even)."""
        if row % 2:
            raise ValueError(f"latent row of {row} values must be even (kv_lora_rank + rope dim)")
        return cls(num_layers, 1, row // 2, page_size, dtype, "mla")

    @property
    def latent_row(self) -> int:
        """Values per token per layer of a latent page (K half + V half)."""
        return 2 * self.head_dim

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

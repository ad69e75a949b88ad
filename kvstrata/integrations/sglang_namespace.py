"""Keys of SGLang's HiCache pages in our stores: SGLang's page hash under a namespace.

SGLang names a page by a hex hash of its tokens (and the previous page's hash). The bytes behind
that name depend on who wrote them, so the namespace carries everything that changes the bytes:
model name, KV dtype, the host pool's page layout and shape, and the rank layout (tp, pp,
attention cp; tp is left out for MLA, whose latent is the same on every tp rank).
    key = xxh3_128("kvstrata-sglang-v1" | namespace | SGLang's page hash)   (128-bit int)
A page of another model, dtype, shape or rank layout is therefore a different key: a miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

KEY_TAG = b"kvstrata-sglang-v1"


@dataclass(frozen=True)
class SGLangNamespace:
    """What, besides the token hash, decides the bytes of one stored page."""

    model_name: str
    """SGLang's storage model name (the served model path or name)."""
    kv_dtype: str
    """The host pool's KV dtype, e.g. torch.bfloat16."""
    page_layout: str
    """The host pool's layout (layer_first, page_first, ...): the byte order of a flat page."""
    page_shape: tuple[int, ...]
    """Layers, heads, head dim, page size of the pool: the size and meaning of a page."""
    rank_layout: str
    """tp/pp/cp/dp ranks and sizes that own this part of the page."""

    def text(self) -> str:
        shape = "x".join(str(d) for d in self.page_shape)
        return (
            f"model={self.model_name}|dtype={self.kv_dtype}|layout={self.page_layout}|"
            f"shape={shape}|{self.rank_layout}"
        )

    def key(self, page_hash: str) -> int:
        """Our 128-bit storage key of SGLang's page hash (hex string) in this namespace."""
        if not isinstance(page_hash, str) or not page_hash:
            raise ValueError(f"SGLang page key must be a non-empty string, got {page_hash!r}")
        raw = KEY_TAG + self.text().encode() + b"|" + page_hash.encode()
        return xxhash.xxh3_128_intdigest(raw)


def rank_layout(
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    cp_rank: int,
    cp_size: int,
    replicated_over_tp: bool,
) -> str:
    """The part of the rank layout that decides which bytes a rank holds (a dp rank does not:
    every attention-dp group holds the same heads, so they share pages)."""
    tp = "tp=replicated" if replicated_over_tp else f"tp={tp_rank}/{tp_size}"
    return f"{tp}|pp={pp_rank}/{pp_size}|cp={cp_rank}/{cp_size}"

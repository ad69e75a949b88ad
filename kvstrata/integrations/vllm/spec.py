"""What the connector needs to know of vLLM's KV cache, read once from vLLM's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.integrations.vllm.config import ConnectorConfigError, VllmConnectorConfig
from kvstrata.memory.layout import KVShape
from kvstrata.storage.units import UnitLayout

_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}


@dataclass(frozen=True)
class KVSpec:
    """vLLM's KV geometry and kvstrata's page over it (per worker: its own KV heads)."""

    block_size: int  # vLLM tokens per block
    page_size: int  # kvstrata tokens per page: block_size x r
    num_layers: int
    kv_heads: int  # the model's KV heads (every worker together)
    tp_size: int
    head_dim: int
    dtype: str  # float32 / float16 / bfloat16
    fingerprint: str  # the model's identity in the keys

    @property
    def local_heads(self) -> int:
        return self.kv_heads // self.tp_size

    @property
    def full_shape(self) -> KVShape:
        """The canonical page (all heads): what storage units are cut from."""
        return KVShape(self.num_layers, self.kv_heads, self.head_dim, self.page_size, self.dtype)

    @property
    def local_shape(self) -> KVShape:
        """One worker's part of a page (its KV heads): what its host pool holds."""
        return KVShape(self.num_layers, self.local_heads, self.head_dim, self.page_size, self.dtype)

    @property
    def page_nbytes(self) -> int:
        return self.local_shape.page_nbytes

    @property
    def units(self) -> UnitLayout:
        """Storage units of every layer x one KV head: any TP size dividing the heads reads them,
        and a page is kv_heads files, not num_layers x kv_heads (90 for SmolLM2) of 1 x 1 units.
        The commit key names the layout, so a reader with other units sees a miss, never bytes."""
        return UnitLayout(self.full_shape, layer_block=self.num_layers)

    def heads_of(self, tp_rank: int) -> tuple[int, int]:
        return tp_rank * self.local_heads, (tp_rank + 1) * self.local_heads


def kv_spec(vllm_config: Any, config: VllmConnectorConfig) -> KVSpec:
    """The spec of the model vLLM serves; ConnectorConfigError names what does not fit."""
    model, cache, par = (
        vllm_config.model_config,
        vllm_config.cache_config,
        vllm_config.parallel_config,
    )
    block = int(cache.block_size)
    page = config.page_size or block
    if page % block:
        raise ConnectorConfigError(
            f"kv_connector_extra_config['page_size'] = {page}: must be a multiple of vLLM's "
            f"block size {block}"
        )
    pp = int(getattr(par, "pipeline_parallel_size", 1))
    if pp != 1:  # a worker's pages and storage units hold every layer
        raise ConnectorConfigError(
            f"kvstrata's vLLM connector does not handle pipeline_parallel_size={pp} (only 1)"
        )
    tp = int(par.tensor_parallel_size)
    heads = int(model.get_total_num_kv_heads())
    if heads % tp:
        raise ConnectorConfigError(
            f"kvstrata needs the {heads} KV heads split evenly over tensor_parallel_size={tp}"
        )
    dtype = _DTYPES.get(str(model.dtype))
    kv_dtype = str(getattr(cache, "cache_dtype", "auto"))
    if dtype is None or kv_dtype != "auto":
        raise ConnectorConfigError(
            f"kvstrata stores float32/float16/bfloat16 KV; vLLM runs dtype {model.dtype}, "
            f"kv_cache_dtype {kv_dtype}"
        )
    return KVSpec(
        block_size=block,
        page_size=page,
        num_layers=int(model.get_num_layers(par)),
        kv_heads=heads,
        tp_size=tp,
        head_dim=int(model.get_head_size()),
        dtype=dtype,
        fingerprint=config.model_fingerprint or str(model.model),
    )

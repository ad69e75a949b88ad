"""Real SGLang objects on CPU, built as SGLang builds them: a device KV pool, its host pool, the
storage config and the backend through SGLang's own factory (tests and `kvstrata bench`)."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

OUR_BACKEND = {
    "backend_name": "kvstrata",
    "module_path": "kvstrata.integrations.sglang_storage",
    "class_name": "KvstrataHiCacheStorage",
}


def host_pool(
    layers: int,
    heads: int,
    head_dim: int,
    page_size: int,
    tokens: int,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "layer_first",
) -> MHATokenToKVPoolHost:
    """An MHA host pool (CPU, not pinned) of `tokens` device tokens x 2, as SGLang sizes it.

    Its host-memory budget is set to what the pool takes (SGLang's own budget scope): without
    it SGLang refuses any pool while free memory is under its fixed reserve, which on a shared
    24 GiB test machine depends on what else runs."""
    dev = MHATokenToKVPool(
        tokens,
        page_size,
        dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=layers,
    )
    pool_bytes = (2 * tokens + 2 * page_size) * 2 * layers * heads * head_dim * dtype.itemsize
    with host_memory_budget_scope(pool_bytes):
        return _host(dev, page_size, layout)


def _host(dev: MHATokenToKVPool, page_size: int, layout: str) -> MHATokenToKVPoolHost:
    return MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
        write_back_staging=dev.hicache_write_back_staging,
    )


def storage_config(
    model_name: str, extra: dict[str, Any] | None, tp_rank: int = 0, tp_size: int = 1
) -> HiCacheStorageConfig:
    """HiCacheStorageConfig as the cache controller fills it for an MHA model, no pp/cp."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model_name,
        extra_config=extra,
    )


def attach(backend_name: str, config: HiCacheStorageConfig, pool: Any) -> HiCacheStorage:
    """The controller's attach: the factory builds the backend, then the host pool registers."""
    backend = StorageBackendFactory.create_backend(backend_name, config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def ours(url: str, pool: Any, model: str = "m", tp: tuple[int, int] = (0, 1)) -> HiCacheStorage:
    """Our backend through `--hicache-storage-backend dynamic` with zero-copy v1 calls."""
    extra = {**OUR_BACKEND, "storage_url": url, "interface_v1": 1}
    return attach("dynamic", storage_config(model, extra, *tp), pool)

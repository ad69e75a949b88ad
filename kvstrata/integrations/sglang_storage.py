"""kvstrata's stores behind SGLang's HiCache (`--hicache-storage-backend dynamic`).

SGLang builds this class from its extra config as `KvstrataHiCacheStorage(storage_config, kwargs)`
and then registers its host pool. Every store of our registry works (chosen by
`extra_config["storage_url"]`: a directory, `file://DIR`, `redis://HOST:PORT/DB`, ...). Each
stored value is our page format (header with key and xxh3-64 checksum), so a corrupt page is a
miss, never wrong KV. Keys are SGLang's page hashes under a namespace (sglang_namespace.py).

One page of SGLang = the host pool's flat data page (`get_data_page(index, flat=True)`), in the
pool's own byte order. Where that page is one contiguous run of the pool (MLA page_first
layouts), reads land in and writes leave from the pool itself (zero copy); otherwise one staging
copy per page (an MHA page is two runs, its K half and its V half).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstrata.integrations.sglang_namespace import SGLangNamespace, rank_layout
from kvstrata.storage.base import StorageBackend, StorageConfig, open_storage

URL_FIELD = "storage_url"  # extra_config field naming our store


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a flat uint8 numpy view (shares memory)."""
    return t.view(-1).view(torch.uint8).numpy()


class KvstrataHiCacheStorage(HiCacheStorage):
    """SGLang HiCacheStorage over any kvstrata storage backend (see the module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        url = extra.get(URL_FIELD)
        if not isinstance(url, str) or not url:
            raise ValueError(
                f"kvstrata HiCache storage needs extra_config['{URL_FIELD}'] "
                "(e.g. 'file:///var/kv' or 'redis://127.0.0.1:6379/0')"
            )
        self.url = url
        self.config = storage_config
        self.rank_layout = rank_layout(
            storage_config.tp_rank,
            storage_config.tp_size,
            storage_config.pp_rank,
            storage_config.pp_size,
            storage_config.attn_cp_rank,
            storage_config.attn_cp_size,
            storage_config.is_mla_model,
        )
        self.store: StorageBackend | None = None
        self.namespace: SGLangNamespace | None = None
        self._lock = threading.Lock()
        self._seen: set[int] = set()  # keys this instance wrote or read (what clear() drops)
        self._metrics: dict[str, list[float]] = {}
        self._reset_metrics()

    # ---- set-up: SGLang registers its host pool right after construction ---------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        shape = (
            mem_pool_host.layer_num,
            getattr(mem_pool_host, "head_num", 1),
            getattr(mem_pool_host, "head_dim", page.numel()),
            mem_pool_host.page_size,
        )
        self.namespace = SGLangNamespace(
            model_name=self.config.model_name or "",
            kv_dtype=str(mem_pool_host.dtype),
            page_layout=str(mem_pool_host.layout),
            page_shape=shape,
            rank_layout=self.rank_layout,
        )
        self.page_nbytes = page.numel() * page.element_size()
        self.store = open_storage(self.url, self.page_nbytes, StorageConfig())

    def _ready(self) -> tuple[StorageBackend, SGLangNamespace]:
        if self.store is None or self.namespace is None:
            raise RuntimeError(
                "kvstrata HiCache storage: no host pool registered yet "
                "(SGLang calls register_mem_pool_host right after construction)"
            )
        return self.store, self.namespace

    def _keys(self, page_hashes: Sequence[str]) -> list[int]:
        _, ns = self._ready()
        keys = [ns.key(h) for h in page_hashes]
        with self._lock:
            self._seen.update(keys)
        return keys

    # ---- the host pool's pages -----------------------------------------------------------------
    def _pool_page(self, index: int) -> torch.Tensor | None:
        """The pool's page at token `index` as a tensor sharing the pool's memory, if it is one
        contiguous run (zero copy possible), else None."""
        page = self.mem_pool_host.get_data_page(index, flat=False)
        return page if page.is_contiguous() else None

    def _page_starts(self, n: int, host_indices: torch.Tensor) -> list[int]:
        size = self.mem_pool_host.page_size
        if host_indices.numel() != n * size:
            raise ValueError(
                f"{n} page keys need {n * size} host indices, got {host_indices.numel()}"
            )
        return [int(i) for i in host_indices[::size].tolist()]

    # ---- v1: straight between the host pool and the store (extra_config interface_v1=1) -------
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        store, _ = self._ready()
        return store.exists_prefix(self._keys(keys))

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        store, _ = self._ready()
        t0 = time.perf_counter()
        starts = self._page_starts(len(keys), host_indices)
        direct = [self._pool_page(s) for s in starts]
        bufs = [
            _bytes_of(p) if p is not None else np.empty(self.page_nbytes, np.uint8) for p in direct
        ]
        n = store.get(self._keys(keys), bufs)
        for i in range(n):
            if direct[i] is None:  # staged: one copy into the pool's (non-contiguous) page
                flat = torch.from_numpy(bufs[i]).view(self.mem_pool_host.dtype)
                self.mem_pool_host.set_from_flat_data_page(starts[i], flat)
        self._record("prefetch", n, time.perf_counter() - t0)
        return [i < n for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        store, _ = self._ready()
        t0 = time.perf_counter()
        starts = self._page_starts(len(keys), host_indices)
        pages = []
        for s in starts:
            p = self._pool_page(s)
            flat = p if p is not None else self.mem_pool_host.get_data_page(s, flat=True)
            pages.append(_bytes_of(flat.contiguous()))
        ours = self._keys(keys)
        stored = store.put(ours, pages)
        self._record("backup", stored, time.perf_counter() - t0)
        return self._stored_flags(store, ours, stored)

    @staticmethod
    def _stored_flags(store: StorageBackend, keys: list[int], stored: int) -> list[bool]:
        """Per key: is it in the store now (a short put is re-probed, leading run)."""
        n = len(keys) if stored == len(keys) else store.exists_prefix(keys)
        return [i < n for i in range(len(keys))]

    # ---- tensors in, tensors out (SGLang's generic path and single pages) ----------------------
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Read pages into the given flat tensors (or new ones); None from the first miss on."""
        store, _ = self._ready()
        targets = list(target_locations or [None] * len(keys))
        for i, t in enumerate(targets):
            if t is None:
                targets[i] = self.mem_pool_host.get_dummy_flat_data_page()
            elif not t.is_contiguous() or t.numel() * t.element_size() != self.page_nbytes:
                raise ValueError(
                    f"batch_get: target {i} must be a contiguous tensor of {self.page_nbytes} bytes"
                )
        n = store.get(self._keys(keys), [_bytes_of(t) for t in targets])
        return [t if i < n else None for i, t in enumerate(targets)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store one flat page tensor per key; True when every page is in."""
        store, _ = self._ready()
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set: {len(keys)} keys need as many page tensors")
        pages = [_bytes_of(v.contiguous()) for v in values]
        return store.put(self._keys(keys), pages) == len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- bookkeeping ---------------------------------------------------------------------------
    def clear(self) -> bool:
        """Drop every page this instance wrote or read. Pages written by other processes (other
        ranks or servers sharing the store) stay: they may still be in use there."""
        store, _ = self._ready()
        with self._lock:
            keys, self._seen = list(self._seen), set()
        store.delete(keys)
        return True

    def _reset_metrics(self) -> None:
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bw": [], "backup_bw": []}

    def _record(self, what: str, pages: int, seconds: float) -> None:
        gb = pages * self.page_nbytes / 1e9
        with self._lock:
            self._metrics[f"{what}_pgs"].append(pages)
            self._metrics[f"{what}_bw"].append(gb / seconds if seconds > 0 else 0.0)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics of the v1 batches since the last call."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            m = self._metrics
            self._reset_metrics()
        return StorageMetrics(
            prefetch_pgs=[int(v) for v in m["prefetch_pgs"]],
            backup_pgs=[int(v) for v in m["backup_pgs"]],
            prefetch_bandwidth=m["prefetch_bw"],
            backup_bandwidth=m["backup_bw"],
        )

    def store_stats(self) -> dict[str, int | float]:
        """Our store's own counters (corrupt pages, hits, misses, bytes)."""
        store, _ = self._ready()
        return store.stats()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def check_integrity(self) -> None:
        store, _ = self._ready()
        store.check_integrity()

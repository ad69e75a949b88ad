"""Whole KV pages between a worker's device pool and host frames (both directions, one place).

The host page layout on the wire is page-first: [layers, 2, page_size, kv_heads, head_dim] per
page (every pool layer, so a speculator's tail layers travel in the same frame). Prefill sends
decode the pages it lacks in it; decode sends prefill the held pages prefill pulls in it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def host_pages(pool: Any, ids: list[int]) -> list[np.ndarray]:
    """Device pages `ids` as host frames: one uint8 row of page_bytes per page (owned copies,
    so the engine may reuse the device pages once this returns)."""
    if not ids:
        return []
    # [layers, 2, k, page, heads, dim] -> page-first [k, layers, 2, page, heads, dim]
    block = pool.data[:, :, pool.local_slot(ids)].permute(2, 0, 1, 3, 4, 5).contiguous()
    flat = block.cpu().reshape(len(ids), -1).view(torch.uint8).numpy()
    return list(flat)


def write_pages(pool: Any, ids: list[int], pages: list[Any]) -> None:
    """Host-layout page frames (verified by the caller) into device pages `ids` (layer-first)."""
    if not ids:
        return
    assert len(ids) == len(pages), f"{len(pages)} page frames for {len(ids)} device pages"
    s = pool.shape
    raw = np.concatenate([np.frombuffer(p, dtype=np.uint8) for p in pages])
    block = torch.from_numpy(raw).view(s.torch_dtype).view(len(ids), *s.host_shape(1)[1:])
    pool.data[:, :, pool.local_slot(ids)] = block.permute(1, 2, 0, 3, 4, 5).to(pool.device)

"""Device pool (layer-first) and host pool (page-first) of KV pages.

DevicePool.data  # [num_layers, 2, capacity_local, page_size, kv_heads, head_dim]
HostPool.data    # [capacity_local, num_layers, 2, page_size, kv_heads, head_dim]

With n_shards > 1 (context parallel) each pool of rank r holds only the pages it owns
(id % n_shards == r) at local slot id // n_shards; its allocator still hands out global logical
ids, identically on every rank. The cache gives a page the same owner in both pools, so device
<-> host copies stay on the owner rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np
import torch

from kvstrata.memory.allocator import PageAllocator
from kvstrata.memory.hugepages import zeros_huge
from kvstrata.memory.layout import KVShape

IdsLike = Sequence[int] | np.ndarray | torch.Tensor


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def as_id_array(ids: IdsLike, name: str, limit: int) -> np.ndarray:
    """1-D int64 numpy copy of `ids`, every id in [0, limit); ValueError naming `name`."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold ints, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() >= limit):
        raise ValueError(f"{name} holds ids outside [0, {limit})")
    return arr


def _check_shards(n_shards: int, rank: int) -> None:
    _positive_int("n_shards", n_shards)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n_shards:
        raise ValueError(f"rank must be an int in [0, n_shards={n_shards}), got {rank!r}")


def owned_slots(ids: np.ndarray, capacity: int, n_shards: int, rank: int) -> np.ndarray:
    """int64 local slots (id // n_shards) of ids in [0, capacity) owned by `rank`; ValueError else."""
    ids = as_id_array(ids, "ids", capacity)
    if n_shards == 1:
        return ids
    if ids.size and np.any(ids % n_shards != rank):
        bad = int(ids[ids % n_shards != rank][0])
        raise ValueError(f"page id {bad} is owned by rank {bad % n_shards}, not {rank}")
    return ids // n_shards


class DevicePool:
    """Device: this rank's KV pages, layer-first so one layer's K (or V) is one tensor."""

    def __init__(
        self, shape: KVShape, capacity: int, device: str = "cpu", n_shards: int = 1, rank: int = 0
    ) -> None:
        _positive_int("capacity", capacity)
        _check_shards(n_shards, rank)
        self.shape = shape
        self.capacity = capacity
        self.n_shards = n_shards
        self.rank = rank
        self.allocator = PageAllocator(capacity, n_shards)  # raises unless capacity % n_shards == 0
        self.capacity_local = capacity // n_shards
        self.device = torch.device(device)
        # [num_layers, 2, capacity_local, page_size, kv_heads, head_dim]
        self.data = zeros_huge(
            shape.device_shape(self.capacity_local), shape.torch_dtype, self.device
        )
        # each layer's K and V views made once: a forward asks for them 2 x layers times, and
        # indexing a 6-D tensor was the largest Python cost of a decode step (bench decode)
        self._k = [self.data[layer, 0] for layer in range(shape.num_layers)]
        self._v = [self.data[layer, 1] for layer in range(shape.num_layers)]

    def k(self, layer: int) -> torch.Tensor:
        """[capacity_local, page_size, kv_heads, head_dim] view of layer `layer`'s keys."""
        self._check_layer(layer)
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        """[capacity_local, page_size, kv_heads, head_dim] view of layer `layer`'s values."""
        self._check_layer(layer)
        return self._v[layer]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.shape.num_layers:
            raise ValueError(f"layer must be in [0, {self.shape.num_layers}), got {layer}")

    def owns(self, page_id: int) -> bool:
        return page_id % self.n_shards == self.rank

    @overload
    def local_slot(self, ids: int) -> int: ...
    @overload
    def local_slot(self, ids: IdsLike) -> torch.Tensor: ...

    def local_slot(self, ids: int | IdsLike) -> int | torch.Tensor:
        """Local slot (id // n_shards) of logical ids owned by this rank; ValueError otherwise.

        An int gives an int; a tensor gives a tensor on its device; a sequence a CPU LongTensor.
        """
        if isinstance(ids, int | np.integer) and not isinstance(ids, bool):
            return int(self.local_slots_np(np.asarray([ids]))[0])
        arr = self.local_slots_np(as_id_array(ids, "ids", self.capacity))
        device = ids.device if isinstance(ids, torch.Tensor) else torch.device("cpu")
        return torch.from_numpy(arr).to(device)

    def local_slots_np(self, ids: np.ndarray) -> np.ndarray:
        """int64 numpy local slots of `ids` (validated: in range and owned by this rank)."""
        return owned_slots(ids, self.capacity, self.n_shards, self.rank)

    def check_integrity(self) -> None:
        s = self.shape
        assert tuple(self.data.shape) == s.device_shape(self.capacity_local), self.data.shape
        assert self.data.dtype == s.torch_dtype and self.data.device == self.device
        assert self.data.is_contiguous()
        assert self.capacity_local * self.n_shards == self.capacity
        self.allocator.check_integrity()


class HostPool:
    """Host: pages in host memory, page-first so one page is one contiguous block of bytes.

    capacity counts logical ids over all shards; this rank stores capacity_local of them."""

    def __init__(
        self,
        shape: KVShape,
        capacity: int,
        pin_memory: bool | None = None,
        n_shards: int = 1,
        rank: int = 0,
    ) -> None:
        _positive_int("capacity", capacity)
        _check_shards(n_shards, rank)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.shape = shape
        self.capacity = capacity
        self.n_shards, self.rank = n_shards, rank
        self.pinned = bool(pin_memory)
        self.allocator = PageAllocator(capacity, n_shards)  # raises unless capacity % n_shards == 0
        self.capacity_local = capacity // n_shards
        # [capacity_local, num_layers, 2, page_size, kv_heads, head_dim]
        self.data = zeros_huge(
            shape.host_shape(self.capacity_local), shape.torch_dtype, pin_memory=self.pinned
        )
        # [capacity_local, page_nbytes] uint8 view sharing memory with data (works for bfloat16)
        self._bytes: np.ndarray = self.data.view(self.capacity_local, -1).view(torch.uint8).numpy()

    def owns(self, page_id: int) -> bool:
        return page_id % self.n_shards == self.rank

    def local_slots_np(self, ids: np.ndarray) -> np.ndarray:
        """int64 local slots of logical host ids owned by this rank (ValueError otherwise)."""
        return owned_slots(ids, self.capacity, self.n_shards, self.rank)

    def page_bytes(self, i: int) -> np.ndarray:
        """uint8 [page_nbytes] view of (logical, owned) host page i (writes go into the pool)."""
        if isinstance(i, bool) or not isinstance(i, int | np.integer) or not 0 <= i < self.capacity:
            raise ValueError(f"host page id must be an int in [0, {self.capacity}), got {i!r}")
        if i % self.n_shards != self.rank:
            raise ValueError(f"host page {i} is owned by rank {i % self.n_shards}, not {self.rank}")
        return self._bytes[i // self.n_shards]

    def check_integrity(self) -> None:
        s = self.shape
        assert tuple(self.data.shape) == s.host_shape(self.capacity_local), self.data.shape
        assert self.data.dtype == s.torch_dtype and self.data.is_contiguous()
        assert self.data.is_pinned() == self.pinned
        assert self._bytes.shape == (self.capacity_local, s.page_nbytes)
        assert self.capacity_local * self.n_shards == self.capacity
        assert self._bytes.ctypes.data == self.data.data_ptr(), "byte view no longer shares memory"
        self.allocator.check_integrity()

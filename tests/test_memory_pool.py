"""KVShape validation, DevicePool (layer-first, sharded) and HostPool (page-first, byte views)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.memory.config import MemoryConfig
from kvstrata.memory.hugepages import advise_huge, zeros_huge
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool, HostPool

torch.set_num_threads(1)
SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, dtype="float16")


def test_kvshape_sizes() -> None:
    assert SHAPE.layer_page_numel == 4 * 2 * 4
    assert SHAPE.page_numel == 3 * 2 * 32
    assert SHAPE.page_nbytes == 3 * 2 * 32 * 2
    assert KVShape(1, 1, 1, 1).torch_dtype == torch.float32
    assert KVShape(1, 1, 1, 1, "bfloat16").page_nbytes == 4


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_kvshape_rejects_bad_sizes_naming_the_field(field: str, bad: object) -> None:
    kwargs: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "page_size": 4}
    kwargs[field] = bad
    with pytest.raises(ValueError, match=field):
        KVShape(**kwargs)  # type: ignore[arg-type]


def test_kvshape_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KVShape(1, 1, 1, 1, dtype="int8")


def test_memory_config_validates() -> None:
    assert MemoryConfig().resolved_copy_threads() >= 1
    with pytest.raises(ValueError, match="copy_threads"):
        MemoryConfig(copy_threads=-1)


def test_device_pool_layout_and_layer_views() -> None:
    pool = DevicePool(SHAPE, 6)
    assert tuple(pool.data.shape) == (3, 2, 6, 4, 2, 4) and pool.data.dtype == torch.float16
    pool.k(1)[2].fill_(1.5)
    pool.v(2)[5].fill_(-2.0)
    assert pool.data[1, 0, 2].eq(1.5).all() and pool.data[2, 1, 5].eq(-2.0).all()
    assert pool.data.count_nonzero() == 2 * SHAPE.layer_page_numel  # views: nothing else written
    assert pool.local_slot(4) == 4 and pool.local_slot([5, 0]).tolist() == [5, 0]
    assert pool.allocator.capacity == 6
    pool.check_integrity()
    with pytest.raises(ValueError, match="layer"):
        pool.k(3)


def test_sharded_device_pool_holds_only_its_own_pages() -> None:
    pool = DevicePool(SHAPE, 8, n_shards=2, rank=1)
    assert pool.capacity_local == 4 and pool.data.shape[2] == 4
    assert pool.data.numel() == DevicePool(SHAPE, 8).data.numel() // 2
    assert pool.owns(3) and not pool.owns(2)
    assert pool.local_slot(7) == 3
    assert pool.local_slot(torch.tensor([1, 5, 3])).tolist() == [0, 2, 1]
    assert pool.allocator.alloc(4) == [0, 1, 2, 3]  # global logical ids, same on every rank
    with pytest.raises(ValueError, match="owned by rank 0"):
        pool.local_slot([1, 2])
    with pytest.raises(ValueError, match="outside"):
        pool.local_slot([9])
    pool.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 8, "n_shards": 0}, "n_shards"),
        ({"capacity": 8, "n_shards": 2, "rank": 2}, "rank"),
        ({"capacity": 8, "n_shards": 2, "rank": -1}, "rank"),
        ({"capacity": 7, "n_shards": 2}, "multiple of n_shards"),
    ],
)
def test_device_pool_bad_input(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DevicePool(SHAPE, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_page_bytes_share_memory_with_the_pool(dtype: str) -> None:
    shape = KVShape(2, 1, 4, 2, dtype)
    pool = HostPool(shape, 3, pin_memory=False)
    assert tuple(pool.data.shape) == (3, 2, 2, 2, 1, 4)
    page = pool.page_bytes(1)
    assert page.dtype == np.uint8 and page.shape == (shape.page_nbytes,)
    page[:] = 0xFF
    assert pool.data[1].view(torch.uint8).eq(0xFF).all()
    assert pool.data[0].count_nonzero() == 0 and pool.data[2].count_nonzero() == 0
    pool.data[2, 1, 1].fill_(1.0)  # last layer, V: the end of page 2's block
    assert pool.page_bytes(2)[-shape.layer_page_numel * shape.itemsize :].any()
    pool.check_integrity()
    for bad in (3, -1, 1.0):
        with pytest.raises(ValueError, match="host page id"):
            pool.page_bytes(bad)  # type: ignore[arg-type]


def test_host_pool_pins_only_when_cuda_is_there() -> None:
    pool = HostPool(SHAPE, 2)
    assert pool.pinned == torch.cuda.is_available() == pool.data.is_pinned()
    with pytest.raises(ValueError, match="capacity"):
        HostPool(SHAPE, 0)


def test_check_integrity_detects_a_replaced_tensor() -> None:
    dev, host = DevicePool(SHAPE, 4), HostPool(SHAPE, 4, pin_memory=False)
    dev.data = torch.zeros(3, 2, 5, 4, 2, 4, dtype=torch.float16)
    host.data = host.data.clone()  # the byte view no longer aliases it
    with pytest.raises(AssertionError):
        dev.check_integrity()
    with pytest.raises(AssertionError):
        host.check_integrity()


def test_pools_are_zeroed_and_huge_page_advice_is_only_a_hint() -> None:
    # a tensor too small to hold a whole OS page pair is never advised; a large one may be
    assert advise_huge(torch.zeros(3)) is False
    t = zeros_huge((4, 1 << 20), torch.float16)  # 8 MiB: spans whole huge pages
    assert t.shape == (4, 1 << 20) and t.dtype == torch.float16 and not t.any()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert advise_huge(t)  # the kernel takes the hint when THP is on at all
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    assert not DevicePool(shape, 8).data.any() and not HostPool(shape, 8).data.any()

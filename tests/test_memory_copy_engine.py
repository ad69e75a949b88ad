"""CopyEngine: bit-exact round trips, per-layer completion, ordering, sharding, errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvstrata.memory.config import MemoryConfig
from kvstrata.memory.copy_engine import CopyEngine, page_runs
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool, HostPool

torch.set_num_threads(1)
SHAPE = KVShape(num_layers=4, num_kv_heads=2, head_dim=4, page_size=4, dtype="bfloat16")


def _random_host(shape: KVShape, capacity: int, seed: int) -> HostPool:
    """Host pool of random *bytes* (NaN payloads included), so equality is bit equality."""
    host = HostPool(shape, capacity, pin_memory=False)
    rng = np.random.default_rng(seed)
    for i in range(capacity):
        host.page_bytes(i)[:] = rng.integers(0, 256, shape.page_nbytes, dtype=np.uint8)
    return host


def _device_page_bytes(dev: DevicePool, slot: int) -> bytes:
    """Bytes of one device page in canonical page-first order (layers, K then V)."""
    return dev.data[:, :, slot].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def pools() -> Iterator[tuple[DevicePool, HostPool, CopyEngine]]:
    """One copy call per layer (tiny pages would group every layer): faults per layer."""
    dev, host = DevicePool(SHAPE, 16), _random_host(SHAPE, 24, seed=1)
    engine = CopyEngine(dev, host, MemoryConfig(copy_threads=1))
    engine._copier.group = 1  # type: ignore[union-attr]
    yield dev, host, engine
    engine.close()


def test_page_runs_groups_pages_consecutive_on_both_sides() -> None:
    src, dst = np.array([4, 5, 6, 9, 10, 2]), np.array([0, 1, 2, 3, 7, 8])
    assert page_runs(src, dst) == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 1)]
    assert page_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_round_trip_host_device_host_is_bit_exact(dtype: str, threads: int, group: int) -> None:
    shape = KVShape(3, 2, 4, 4, dtype)
    dev, host = DevicePool(shape, 20), _random_host(shape, 40, seed=2)
    # shuffled pages with one run consecutive on both sides (30..33 -> 4..7) and one consecutive
    # on the host side only (10, 11, 12 -> 0, 15, 11)
    dev_ids = np.array([9, 2, 4, 5, 6, 7, 0, 15, 11, 1, 18])
    src = np.array([17, 5, 30, 31, 32, 33, 10, 11, 12, 0, 39])
    back = np.array([1, 2, 4, 6, 7, 8, 9, 13, 14, 15, 16])  # disjoint from src
    expected = [host.page_bytes(int(h)).tobytes() for h in src]
    with CopyEngine(dev, host, MemoryConfig(copy_threads=threads)) as engine:
        engine._copier.group = group  # type: ignore[union-attr]  # 3 layers: 1+1+1, 2+1, 3
        engine.load(src.tolist(), torch.from_numpy(dev_ids)).wait()
        assert [_device_page_bytes(dev, int(d)) for d in dev_ids] == expected
        engine.store(dev_ids, back).wait()
    assert [host.page_bytes(int(b)).tobytes() for b in back] == expected
    dev.check_integrity()
    host.check_integrity()


def test_every_layer_is_correct_once_wait_layer_returns(pools: tuple) -> None:
    dev, host, engine = pools
    host_ids, dev_ids = [7, 3, 20, 11], [9, 0, 15, 4]
    handle = engine.load(host_ids, dev_ids)
    assert handle.nbytes == 4 * SHAPE.page_nbytes and handle.kind == "load"
    for layer in range(SHAPE.num_layers):
        handle.wait_layer(layer)
        for h, d in zip(host_ids, dev_ids, strict=True):
            assert torch.equal(
                dev.data[layer, :, d].view(torch.int16), host.data[h, layer].view(torch.int16)
            )
    assert handle.is_done()
    with pytest.raises(ValueError, match="layer"):
        handle.wait_layer(SHAPE.num_layers)


def test_layers_are_copied_in_groups_of_at_least_layer_group_bytes_per_page() -> None:
    """Per copy call at least LAYER_GROUP_BYTES of a page (whole layers, never past the last);
    a failed group fails from its first layer, the groups before it stay usable."""
    big = KVShape(num_layers=24, num_kv_heads=8, head_dim=64, page_size=64, dtype="float16")
    with CopyEngine(DevicePool(big, 2), HostPool(big, 2, pin_memory=False)) as engine:
        assert engine._copier.group == 4  # type: ignore[union-attr]  # 128 KiB a layer
    dev, host = DevicePool(SHAPE, 16), _random_host(SHAPE, 24, seed=6)
    with CopyEngine(dev, host, MemoryConfig(copy_threads=1)) as engine:
        assert engine._copier.group == SHAPE.num_layers  # type: ignore[union-attr]
        engine._copier.group = 3  # type: ignore[union-attr]  # layers 0-2, then 3
        calls: list[range] = []
        real = engine._copier.copy_layers

        def failing_second_group(kind: str, layers: range, runs: list) -> None:
            calls.append(layers)
            if 3 in layers:
                raise OSError("injected")
            real(kind, layers, runs)

        engine._copier.copy_layers = failing_second_group  # type: ignore[method-assign]
        handle = engine.load([5, 6], [1, 2])
        with pytest.raises(RuntimeError, match="failed at layer 3"):
            handle.wait(timeout=10)
        assert calls == [range(0, 3), range(3, 4)]
        handle.wait_layer(2)
        assert torch.equal(dev.data[:3, :, 1], host.data[5, :3])


def test_completed_count_is_a_prefix_in_submission_order(pools: tuple) -> None:
    dev, host, engine = pools
    handles = [engine.load([i], [i]) for i in range(6)] + [engine.store([0, 1], [22, 23])]
    seen = []
    while (c := engine.completed_count()) < len(handles):
        seen.append(c)
    assert seen == sorted(seen)  # monotonic
    for h in handles:
        h.wait()
        assert h.is_done() and h.error is None
    assert engine.completed_count() == engine.submitted_count() == 7
    assert host.page_bytes(22).tobytes() == host.page_bytes(0).tobytes()
    stats = engine.stats()
    assert stats["load_ops"] == 6 and stats["store_ops"] == 1
    assert (
        stats["load_bytes"] == 6 * SHAPE.page_nbytes
        and stats["store_bytes"] == 2 * SHAPE.page_nbytes
    )


def test_a_blocked_op_is_not_counted_and_later_ops_wait_behind_it(pools: tuple) -> None:
    dev, host, engine = pools
    release = threading.Event()
    real = engine._copier.copy_layers

    def slow_copy_layer(kind: str, layers: range, runs: list) -> None:
        release.wait(10)  # fault injection: a copy that takes long
        real(kind, layers, runs)

    engine._copier.copy_layers = slow_copy_layer  # type: ignore[method-assign]
    first, second = engine.load([1], [1]), engine.load([2], [2])
    with pytest.raises(TimeoutError):
        first.wait(timeout=0.05)
    assert not first.is_done() and not second.is_done() and engine.completed_count() == 0
    release.set()
    second.wait(timeout=10)
    assert first.is_done() and engine.completed_count() == 2


def test_a_worker_error_surfaces_in_wait_and_the_engine_keeps_working(pools: tuple) -> None:
    dev, host, engine = pools
    real = engine._copier.copy_layers

    def failing_copy_layer(kind: str, layers: range, runs: list) -> None:
        if 2 in layers:
            raise OSError("injected copy failure")
        real(kind, layers, runs)

    engine._copier.copy_layers = failing_copy_layer  # type: ignore[method-assign]
    handle = engine.load([5], [6])
    with pytest.raises(RuntimeError, match="failed at layer 2") as info:
        handle.wait(timeout=10)
    assert isinstance(info.value.__cause__, OSError)
    handle.wait_layer(1)  # layers before the failure are complete and usable
    with pytest.raises(RuntimeError):
        handle.wait_layer(3, timeout=10)
    assert handle.is_done() and isinstance(handle.error, OSError)
    assert engine.completed_count() == 1 and engine.stats()["failed_ops"] == 1
    engine._copier.copy_layers = real  # type: ignore[method-assign]
    engine.load([5], [6]).wait(timeout=10)
    assert _device_page_bytes(dev, 6) == host.page_bytes(5).tobytes()


def test_sharded_device_pool_loads_owned_pages_into_local_slots() -> None:
    dev = DevicePool(SHAPE, 16, n_shards=2, rank=1)
    host = _random_host(SHAPE, 8, seed=4)
    with CopyEngine(dev, host) as engine:
        engine.load([0, 1, 2], [3, 13, 7]).wait()  # local slots 1, 6, 3
        assert [_device_page_bytes(dev, s) for s in (1, 6, 3)] == [
            host.page_bytes(i).tobytes() for i in range(3)
        ]
        engine.store([13], [7]).wait()
        assert host.page_bytes(7).tobytes() == host.page_bytes(1).tobytes()
        with pytest.raises(ValueError, match="owned by rank 0"):
            engine.load([0], [2])


def test_bad_input_is_rejected_at_submission(pools: tuple) -> None:
    dev, host, engine = pools
    with pytest.raises(ValueError, match="differ in length"):
        engine.load([1, 2], [3])
    with pytest.raises(ValueError, match="device_ids holds a page twice"):
        engine.load([1, 2], [3, 3])
    with pytest.raises(ValueError, match="host_ids holds a page twice"):
        engine.store([1, 2], [3, 3])
    with pytest.raises(ValueError, match="host_ids holds ids outside"):
        engine.load([24], [0])
    with pytest.raises(ValueError, match="device_ids holds ids outside"):
        engine.store([-1], [0])
    with pytest.raises(ValueError, match="1-D"):
        engine.load([[1]], [[2]])
    with pytest.raises(ValueError, match="ints"):
        engine.load([1.5], [2])
    one = np.array([1])
    for layers in (range(0), range(0, 5), range(0, 4, 2)):  # empty, past the last, strided
        with pytest.raises(ValueError, match="non-empty range within 4"):
            engine.submit("load", one, one, layers)
    with pytest.raises(ValueError, match="from 0 on"):
        engine.submit("load", one, one, range(1, 2))  # the pool copiers move whole pages
    assert engine.submitted_count() == 0
    empty = engine.load([], [])
    empty.wait(timeout=10)
    assert empty.nbytes == 0 and engine.completed_count() == 1
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.load([1], [1])


def test_pools_of_different_shapes_are_rejected() -> None:
    other = KVShape(4, 2, 4, 4, "float16")
    with pytest.raises(ValueError, match="shape"):
        CopyEngine(DevicePool(SHAPE, 4), HostPool(other, 4, pin_memory=False))


def test_a_failure_in_one_copy_thread_fails_the_op_without_hanging() -> None:
    dev, host = DevicePool(SHAPE, 16), _random_host(SHAPE, 16, seed=5)
    with CopyEngine(dev, host, MemoryConfig(copy_threads=2)) as engine:
        engine._copier.group = 1  # type: ignore[union-attr]
        real = engine._copier.copy_layers

        def failing_copy_layer(kind: str, layers: range, runs: list) -> None:
            if 2 in layers and any(s == 15 for s, _, _ in runs):
                raise OSError("injected")
            real(kind, layers, runs)

        engine._copier.copy_layers = failing_copy_layer  # type: ignore[method-assign]
        src, dst = list(range(8, 16)), [0, 2, 4, 6, 8, 10, 12, 14]  # 8 runs: two threads share them
        handle = engine.load(src, dst)
        with pytest.raises(RuntimeError, match="failed at layer") as info:
            handle.wait(timeout=10)
        assert isinstance(info.value.__cause__, OSError)
        failed_from = handle._failed_from
        assert 0 <= failed_from <= 2
        for layer in range(failed_from):  # completed layers hold the right bytes
            handle.wait_layer(layer)
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(
                    dev.data[layer, :, d].view(torch.int16), host.data[s, layer].view(torch.int16)
                )
        engine._copier.copy_layers = real  # type: ignore[method-assign]
        engine.load(src, dst).wait(timeout=10)
        assert [_device_page_bytes(dev, d) for d in dst] == [
            host.page_bytes(s).tobytes() for s in src
        ]

"""The vLLM connector's extra config: every bad key or value is one line naming the key."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from kvstrata.integrations.vllm.config import ConnectorConfigError, VllmConnectorConfig
from kvstrata.integrations.vllm.spec import KVSpec, kv_spec
from kvstrata.integrations.vllm.worker import WorkerSide


def refused(extra: dict) -> str:
    with pytest.raises(ConnectorConfigError) as exc:
        VllmConnectorConfig.from_extra(extra)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_fields_by_name() -> None:
    cfg = VllmConnectorConfig.from_extra(
        {"host_pages": "64", "storage_url": "file:///tmp/x", "prefetch_policy": "wait_complete"}
    )
    assert (cfg.host_pages, cfg.prefetch_policy) == (64, "wait_complete")
    assert VllmConnectorConfig.from_extra({"host_bytes": 4096}).resolved_host_pages(1000) == 4


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"host_pages": 8, "hots_pages": 1}, "'hots_pages'"),
        ({"host_pages": "many"}, "'host_pages'"),
        ({"host_pages": -1}, "'host_pages'"),
        ({}, "'host_pages'"),
        ({"host_pages": 8, "write_policy": "write_sometimes"}, "'write_policy'"),
        ({"host_pages": 8, "write_through_threshold": 0}, "'write_through_threshold'"),
        ({"host_pages": 8, "prefetch_policy": "eager"}, "'prefetch_policy'"),
        ({"host_pages": 8, "eviction": "fifo"}, "'eviction'"),
        ({"host_pages": 8, "check_integrity": "yes"}, "'check_integrity'"),
        ({"host_pages": 8, "prefetch_timeout_base_s": -1.0}, "'prefetch_timeout_base_s'"),
        ({"host_pages": 8, "copy_mode": "async"}, "'copy_mode'"),
        ({"host_pages": 8, "copy_timeout_s": 0}, "'copy_timeout_s'"),
    ],
)
def test_bad_values_name_the_key(extra: dict, named: str) -> None:
    assert named in refused(extra)


def test_host_bytes_too_small_for_a_page() -> None:
    cfg = VllmConnectorConfig.from_extra({"host_bytes": 10})
    with pytest.raises(ConnectorConfigError, match="'host_bytes'"):
        cfg.resolved_host_pages(1000)


def test_copy_mode_auto_is_layer_by_layer_on_cuda_only() -> None:
    auto = VllmConnectorConfig.from_extra({"host_pages": 8})
    assert (auto.layer_copies("cpu"), auto.layer_copies("cuda")) == (False, True)
    layer = VllmConnectorConfig.from_extra({"host_pages": 8, "copy_mode": "layer"})
    step = VllmConnectorConfig.from_extra({"host_pages": 8, "copy_mode": "step"})
    assert (layer.layer_copies("cpu"), step.layer_copies("cuda")) == (True, False)


def test_pipeline_parallel_is_refused_by_name() -> None:
    """A worker's host pages and storage units hold every layer: PP > 1 is not handled."""
    vllm_config = SimpleNamespace(  # the three parts of vLLM's config kv_spec reads
        model_config=None,
        cache_config=SimpleNamespace(block_size=32),
        parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1),
    )
    with pytest.raises(ConnectorConfigError, match="pipeline_parallel_size=2"):
        kv_spec(vllm_config, VllmConnectorConfig.from_extra({"host_pages": 8}))


def _smollm2_spec(block: int) -> KVSpec:
    """SmolLM2-135M's KV geometry under vLLM's CPU block size (what kv_spec reads from vLLM)."""
    return KVSpec(block, block, 30, 3, 1, 64, "float32", "smollm2")


@pytest.mark.parametrize("key", ["host_pages", "host_bytes"])
def test_a_host_pool_beyond_available_memory_is_refused_before_allocation(key: str) -> None:
    """README's host_pages under vLLM's CPU default of 128-token blocks (not README's
    --block-size 32) asked for more than the machine had, and the worker was SIGKILLed while
    allocating: the worker side now refuses first, naming the key and the bytes."""
    spec = _smollm2_spec(128)
    avail = psutil.virtual_memory().available
    pages = 4 * avail // spec.page_nbytes + 1  # four times what is available
    extra = (
        {"host_pages": pages} if key == "host_pages" else {"host_bytes": pages * spec.page_nbytes}
    )
    config = VllmConnectorConfig.from_extra(extra)
    with pytest.raises(ConnectorConfigError) as exc:
        WorkerSide(config, spec, 0)  # the worker role's start, before any pool byte
    msg = str(exc.value)
    assert f"kv_connector_extra_config[{key!r}]" in msg and "\n" not in msg
    assert f"{pages * spec.page_nbytes:,} bytes" in msg and "available" in msg
    small = VllmConnectorConfig.from_extra(
        {key: 8 if key == "host_pages" else 8 * spec.page_nbytes}
    )
    assert small.host_pool_pages(spec.page_nbytes) == 8


@pytest.mark.slow
def test_vllm_stops_at_start_naming_an_oversized_host_pool(tmp_path: Path) -> None:
    """A real vLLM start (SmolLM2) asked for a host pool four times the memory available: it
    stops while starting, its log naming the key and the bytes, nothing allocated (it was
    SIGKILLed by the kernel before)."""
    from kvstrata.bench.vllm_server import VllmServer
    from kvstrata.model.smollm2 import ensure_smollm2

    spec = _smollm2_spec(32)
    pages = 4 * psutil.virtual_memory().available // spec.page_nbytes + 1
    log = tmp_path / "vllm.log"
    server = VllmServer(ensure_smollm2(), log, connector={"host_pages": pages}, startup_s=300)
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.start()
    finally:
        server.stop()
    text = log.read_text()
    assert "kv_connector_extra_config['host_pages']" in text and "available" in text

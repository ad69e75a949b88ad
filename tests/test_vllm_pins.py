"""Client pins under vLLM: kv_transfer_params pin a prompt in the connector's host tier.

tests/vllm_pins_driver.py plays vLLM's engine loop (vLLM's own request and scheduler-output
types, real KV tensors) around the connector's two sides: request a pins its 2 pages
(`kv_pin_s`), a bad pin value is ignored, 12 pages of other prompts pass through the 8 host
pages, and a later request with a's prompt loads a's pages from host memory, byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm_drivers import run_driver

pytestmark = pytest.mark.slow


def test_pinned_prompt_stays_in_the_connectors_host_tier() -> None:
    (r,) = run_driver(Path(__file__).with_name("vllm_pins_driver.py"))
    assert r["s0_matched"] == 0  # the storm took every unpinned page
    assert r["a2_matched"] == 8  # a's 2 pinned pages, from host memory
    assert r["loaded_exact"] and r["stored_exact"]
    assert r["made"] == 1 and r["pinned"] == 2

"""Write policies under vLLM: which pages are copied to host memory, when, and that vLLM keeps a
finished request's blocks exactly while a store still reads them.

tests/vllm_policies_driver.py runs under .venv-vllm (vLLM's own request and scheduler-output
types) and plays vLLM's engine loop around the connector's two sides with real KV tensors.
Request a (2 full pages) runs; b, with the same prompt, is admitted on vLLM's own hit of a's
blocks while a still runs; a finishes, then b. Or a is preempted (vLLM frees its blocks) and
aborted. Every stored host page is compared byte for byte with the vLLM block it was read from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm_drivers import run_driver

DRIVER = Path(__file__).with_name("vllm_policies_driver.py")
POLICIES = ("write_through", "write_back", "write_through_selective")


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["policy"], r["scenario"]): r for r in run_driver(DRIVER, *POLICIES)}


def steps(r: dict[str, Any]) -> list[tuple[str, object, object]]:
    """(step, pages stored / delay_free, finished_sending) in order."""
    return [
        (s["step"], s.get("stored_pages", s.get("delay_free")), s.get("finished_sending"))
        for s in r["log"]
    ]


EXPECTED_TWO = {
    # every page in the step that computed it; nothing is left to copy when a request ends
    "write_through": [2, 0, False, 0, False, 0],
    # nothing while a runs; a's end leaves b holding the pages; b's end copies them from b's
    # blocks, which vLLM keeps until the workers report b
    "write_back": [0, 0, False, 0, True, 2],
    # b's match is the pages' first hit (threshold 1): copied from the blocks a and b share
    "write_through_selective": [0, 2, False, 0, False, 0],
}


@pytest.mark.parametrize("policy", POLICIES)
def test_pages_stored_when_the_policy_says(
    runs: dict[tuple[str, str], dict[str, Any]], policy: str
) -> None:
    r = runs[(policy, "two")]
    names = ["prefill a", "prefill b", "finish a", "after finish a", "finish b", "after finish b"]
    sending = [[], [], None, [], None, ["b"] if policy == "write_back" else []]
    assert steps(r) == list(zip(names, EXPECTED_TWO[policy], sending, strict=True))
    assert r["exact"] and r["host_pages_used"] == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_a_preempted_request_blocks_are_never_read(
    runs: dict[tuple[str, str], dict[str, Any]], policy: str
) -> None:
    """vLLM freed a's blocks at preemption: no later store reads them (write_back loses the
    pages: a miss, never stale bytes), and its abort keeps no block."""
    r = runs[(policy, "preempted")]
    first = 2 if policy == "write_through" else 0
    assert steps(r) == [
        ("prefill a", first, []),
        ("preempt a", 0, []),
        ("abort a", False, None),
        ("after abort a", 0, []),
    ]
    assert r["exact"] and r["host_pages_used"] == first

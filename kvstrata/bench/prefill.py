"""`kvstrata bench prefill`: kvstrata's cold prefill and decode against plain transformers.

In one process, on SmolLM2 and the same random prompts: kvstrata's cold prefill (TTFT of a
prompt on an engine without a cache, its pool reused across rounds as a serving engine's is)
against one transformers forward of the same prompt
(`AutoModelForCausalLM`, sdpa, `logits_to_keep=1`, inference mode, the same torch threads).
The two alternate in every round, so drifting load on a shared machine hits both alike; each
side's median over the rounds is compared. Decode: tokens/s of kvstrata's greedy decode against
transformers `generate` (greedy, KV cache on), both timed from the first generated token to the
last. Also the TTFT of a prompt whose prefix is a device hit. Ratios: ours / transformers time for
prefill (goal <= 1.0), ours / transformers tokens/s for decode (goal >= 1.0).
Then ms per prefilled token, cold and over a cached prefix, ours against transformers and, with
`--vllm-url`, a vLLM server (prefill_per_token.py; start it with the threads this run uses).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstrata.bench.prefill_per_token import Case, VllmPrompt, measure_case
from kvstrata.bench.registry import BENCHES
from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine, resolve_model_path
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM

PAGE = 64
PREFILL_GOAL, DECODE_GOAL = 1.0, 1.0


def label(n: int) -> str:
    """2048 -> "2k"; sizes below 1024 keep their number."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def engine_for(model: DecoderLM, tokens: int, tiers: str = "device") -> Engine:
    """An engine whose device memory holds one prompt of `tokens` plus its decode (cache empty).

    Its pool is touched once here, as a serving engine's long-lived pool is: first-touch page
    faults of a fresh pool belong to start-up, not to a request's TTFT.
    """
    cfg = CacheConfig(page_size=PAGE, device_pages=tokens // PAGE + 8, host_pages=0)
    eng = build_engine(EngineConfig(), cfg.with_tiers(tiers), model=model).engine
    eng.pool.data.fill_(0)
    return eng


def serve(eng: Engine, tokens: list[int], new: int) -> Request:
    req = Request(f"r{eng.steps}", tokens, max_new_tokens=new)
    eng.submit(req)
    while eng.has_work():
        eng.step()
    eng.check_integrity()
    return req


class HF:
    """The plain transformers reference on the same checkpoint."""

    def __init__(self, path: Path, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).eval()

    def prefill(self, tokens: list[int]) -> int:
        """First greedy token of one forward over `tokens`."""
        with torch.inference_mode():
            out = self.model(torch.tensor([tokens]), logits_to_keep=1, use_cache=False)
        return int(out.logits[0, -1].argmax())

    def decode_rate(self, tokens: list[int], new: int) -> tuple[float, list[int]]:
        """Tokens/s of greedy `generate` after its first token; and the generated ids."""
        stamps: list[float] = []

        class Stamp:
            def put(self, _: torch.Tensor) -> None:  # the prompt, then one call per new token
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        with torch.inference_mode():
            ids = self.model.generate(
                torch.tensor([tokens]),
                attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                streamer=Stamp(),
                pad_token_id=0,
            )
        # stamps[0] is the prompt, stamps[1] the first generated token
        return (new - 1) / (stamps[-1] - stamps[1]), ids[0, len(tokens) :].tolist()


def _interleaved(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Seconds each fn reports over `rounds`, alternating in each round (who goes first too)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(rounds):
        for name, fn in items if r % 2 == 0 else items[::-1]:
            times[name].append(fn())
    return times


def prefill_case(model: DecoderLM, hf: HF, n: int, rounds: int) -> dict[str, Any]:
    tokens = prompt(n, model.vocab_size, seed=n)
    firsts: dict[str, int] = {}

    eng = engine_for(model, n, tiers="none")  # no cache: every round is a cold prefill

    def ours() -> float:
        req = serve(eng, tokens, 1)  # TTFT counts from submit
        firsts["ours"] = req.output[0]
        return req.ttft_s

    def theirs() -> float:
        t0 = time.perf_counter()
        firsts["hf"] = hf.prefill(tokens)
        return time.perf_counter() - t0

    t = _interleaved({"ours": ours, "hf": theirs}, rounds)
    ours_s, hf_s = statistics.median(t["ours"]), statistics.median(t["hf"])
    return {"ours_s": ours_s, "hf_s": hf_s, "same_token": firsts["ours"] == firsts["hf"]}


def decode_case(model: DecoderLM, hf: HF, n: int, new: int, rounds: int) -> dict[str, Any]:
    """Median tokens/s of each side over `rounds` alternating runs (after the shared warm-up)."""
    tokens = prompt(n, model.vocab_size, seed=1)
    out: dict[str, Any] = {}
    eng = engine_for(model, n + new, tiers="none")

    def ours() -> float:
        req = serve(eng, tokens, new)
        assert req.first_token_s is not None and req.finish_s is not None
        out["ours_tokens"] = req.output
        return (new - 1) / (req.finish_s - req.first_token_s)

    def theirs() -> float:
        rate, out["hf_tokens"] = hf.decode_rate(tokens, new)
        return rate

    t = _interleaved({"ours": ours, "hf": theirs}, rounds)
    return {
        "ours_tps": statistics.median(t["ours"]),
        "hf_tps": statistics.median(t["hf"]),
        "same_tokens": out["ours_tokens"] == out["hf_tokens"],
    }


def hit_ttft(model: DecoderLM, n: int) -> float:
    """TTFT of a prompt whose first n - 1 tokens' full pages are a device hit (median of 3)."""
    tokens = prompt(n, model.vocab_size, seed=7)
    eng = engine_for(model, n)
    serve(eng, tokens, 1)  # cold: fills device memory
    reqs = [serve(eng, tokens, 1) for _ in range(3)]
    assert all(r.hits["device"] == (n - 1) // PAGE for r in reqs), [r.hits for r in reqs]
    return statistics.median(r.ttft_s for r in reqs)


def per_token(
    model: DecoderLM, hf: HF, cases: tuple[Case, ...], rounds: int, vllm_url: str | None
) -> dict[str, Any]:
    """ms per prefilled token of each case, ours / transformers / vLLM (see prefill_per_token)."""
    vllm = VllmPrompt(vllm_url) if vllm_url else None
    report: dict[str, Any] = {"vllm": vllm_url or "not measured"}
    for case in cases:
        tiers = "device" if case.prefix else "none"
        eng = engine_for(model, case.prefix + case.new * (rounds + 2), tiers=tiers)
        report.update(measure_case(case, eng, hf.model, vllm, rounds, PAGE))
    return report


def measure(
    sizes: tuple[int, ...],
    hit_n: int,
    rounds: int,
    new: int,
    cases: tuple[Case, ...] = (),
    vllm_url: str | None = None,
) -> dict[str, Any]:
    path = resolve_model_path(EngineConfig())
    model, hf = load_model(path), HF(path)
    warm = prompt(256, model.vocab_size, seed=0)  # one warm-up of both sides (kernels, caches)
    serve(engine_for(model, 256), warm, 2)
    hf.prefill(warm)
    report: dict[str, Any] = {"threads": torch.get_num_threads(), "page_size": PAGE}
    same = True
    for n in sizes:
        c = prefill_case(model, hf, n, rounds)
        report[f"prefill_ours_s_{label(n)}"] = c["ours_s"]
        report[f"prefill_hf_s_{label(n)}"] = c["hf_s"]
        report[f"prefill_ratio_vs_hf_{label(n)}"] = c["ours_s"] / c["hf_s"]
        same = same and c["same_token"]
    d = decode_case(model, hf, 256, new, rounds)
    report.update(decode_ours_tps=d["ours_tps"], decode_hf_tps=d["hf_tps"])
    report["decode_ratio_vs_hf"] = d["ours_tps"] / d["hf_tps"]
    report[f"hit_ttft_{label(hit_n)}_s"] = hit_ttft(model, hit_n)
    report["same_tokens_as_hf"] = same and d["same_tokens"]
    report.update(prefill_goal=PREFILL_GOAL, decode_goal=DECODE_GOAL)
    report.update(per_token(model, hf, cases, rounds, vllm_url))
    return report


@BENCHES.register("prefill")
def bench_prefill(quick: bool, vllm_url: str | None = None) -> dict[str, Any]:
    """SmolLM2-135M; prompts 2k/4k/8k, 3 rounds; per token: 1024 cold, 256 over a cached 2048
    (quick: 512/1k, 1 round; 256 cold, 64 over 256; keys named by size)."""
    if quick:
        cases = (Case("cold", 256), Case("cached", 64, 256))
        return measure((512, 1024), 1024, rounds=1, new=16, cases=cases, vllm_url=vllm_url)
    cases = (Case("cold", 1024), Case("cached", 256, 2048))
    return measure((2048, 4096, 8192), 4096, rounds=3, new=64, cases=cases, vllm_url=vllm_url)

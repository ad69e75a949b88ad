"""`kvstrata bench decode`: batched decode of our engine against transformers and vLLM.

In one process, per dtype (fp32, bf16) on SmolLM2: our engine decodes batches of 1, 8 and 32
random prompts (1024 tokens, 128 out, no cache, so no hits) and reports output tok/s over the
steps where every sequence decodes, TPOT p50, the Python time per decode step (step wall time
less the model's forward) and the memory-bound step time: the bytes a step must read (weights +
the batch's KV) over the copy bandwidth measured here. Against (a) transformers `generate` of
one sequence at a time (its tok/s is the same at any batch) and (b) vLLM's OpenAI server of the
same checkpoint, one per dtype: `--vllm-url` (served with `--dtype float32`) for the fp32 rows,
`--vllm-bf16-url` (`--dtype bfloat16`) for the bf16 rows; the same prompts as token ids,
`ignore_eos`, streamed, B at once. A dtype without its server has no vLLM rows.
One cProfile of a batch-8 run names the Python functions that dominate a step.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.bench.prefill import HF, prompt
from kvstrata.bench.registry import BENCHES
from kvstrata.bench.vllm_client import vllm_decode
from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine, resolve_model_path
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM
from kvstrata.model.paged_decode import isa
from kvstrata.model.small_matmul import isa as matmul_isa

PAGE = 64


@dataclass(frozen=True)
class Case:
    """One size of the benchmark."""

    prompt: int  # prompt tokens
    new: int  # output tokens per request (ignore_eos)
    batches: tuple[int, ...]  # requests decoding at once


FULL, QUICK = Case(1024, 128, (1, 8, 32)), Case(64, 8, (1, 4))


class ForwardTimer:
    """Seconds spent in the model's forward, by forward hooks (summed until read)."""

    def __init__(self, model: DecoderLM) -> None:
        self.total, self._t0 = 0.0, 0.0
        model.register_forward_pre_hook(lambda *_: self._start())
        model.register_forward_hook(lambda *_: self._stop())

    def _start(self) -> None:
        self._t0 = time.perf_counter()

    def _stop(self) -> None:
        self.total += time.perf_counter() - self._t0


def engine_for(model: DecoderLM, case: Case, batch: int) -> Engine:
    """An engine without a cache whose pool and running set hold `batch` requests."""
    pages = batch * (-(-(case.prompt + case.new) // PAGE) + 1)
    cfg = CacheConfig(page_size=PAGE, device_pages=pages, host_pages=0, prefix_cache=False)
    config = EngineConfig(max_running=batch, dtype=model.dtype_name)
    eng = build_engine(config, cfg, model=model).engine
    eng.pool.data.fill_(0)  # first-touch faults belong to start-up
    return eng


def run_batch(eng: Engine, timer: ForwardTimer, case: Case, batch: int) -> dict[str, float]:
    """Decode `batch` requests at once; tok/s and per-step times over all-decode steps."""
    reqs = [
        Request(f"b{batch}-{i}", prompt(case.prompt, eng.model.vocab_size, seed=100 + i),
                max_new_tokens=case.new)
        for i in range(batch)
    ]  # fmt: skip
    for r in reqs:
        eng.submit(r)
    while any(r.first_token_s is None for r in reqs):  # prefill (not timed here)
        eng.step()
    steps, python, tokens = [], [], 0
    while eng.has_work():
        before, fwd = sum(len(r.output) for r in reqs), timer.total
        t0 = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t0
        steps.append(wall)
        python.append(wall - (timer.total - fwd))
        tokens += sum(len(r.output) for r in reqs) - before
    eng.check_integrity()
    tpot = [(r.finish_s - r.first_token_s) / (case.new - 1) for r in reqs]  # type: ignore[operator]
    return {
        "tps": tokens / sum(steps),
        "tpot_p50_ms": 1e3 * statistics.median(tpot),
        "step_ms": 1e3 * statistics.median(steps),
        "python_ms": 1e3 * statistics.median(python),
    }


def copy_bandwidth() -> float:
    """Bytes per second of a large host copy (read + write counted), best of 3."""
    src = torch.ones(64 * 2**20)  # 256 MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def memory_bound_ms(model: DecoderLM, case: Case, batch: int, bandwidth: float) -> float:
    """A decode step's bytes read (every weight once, each sequence's KV) / copy bandwidth."""
    weights = sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values())
    kv_token = model.kv_shape(PAGE).page_nbytes // PAGE
    kv = batch * (case.prompt + case.new // 2) * kv_token  # the mean context of the run
    return 1e3 * (weights + kv) / bandwidth


def python_profile(eng: Engine, timer: ForwardTimer, case: Case, top: int = 6) -> str:
    """The kvstrata functions outside model/ with the most own time over a batch-8 run."""
    prof = cProfile.Profile()
    prof.enable()
    run_batch(eng, timer, case, min(8, eng.config.max_running))
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    ours = [
        (tt, f"{fn.split('kvstrata/')[-1]}:{name}")
        for (fn, _, name), (_, _, tt, _, _) in stats.items()
        if "kvstrata/" in fn and "/model/" not in fn and "/bench/" not in fn
    ]
    return "; ".join(f"{name} {1e3 * tt:.1f}ms" for tt, name in sorted(ours, reverse=True)[:top])


def measure_dtype(dtype: str, case: Case, vllm_url: str | None) -> dict[str, Any]:
    """One dtype's rows; `vllm_url` is a vLLM server started with this dtype (or None)."""
    path = resolve_model_path(EngineConfig())
    model = load_model(path, dtype=dtype)
    timer, bandwidth, out = ForwardTimer(model), copy_bandwidth(), {}
    hf = HF(path, dtype)
    tokens = prompt(case.prompt, model.vocab_size, seed=100)
    hf_tps = statistics.median(hf.decode_rate(tokens, case.new)[0] for _ in range(2))
    out["hf_generate_tps"] = hf_tps
    for b in case.batches:
        eng = engine_for(model, case, b)
        run_batch(eng, timer, Case(case.prompt, 2, (b,)), b)  # warm-up
        got = run_batch(eng, timer, case, b)
        out.update({f"b{b}_{k}": v for k, v in got.items()})
        out[f"b{b}_memory_bound_step_ms"] = memory_bound_ms(model, case, b, bandwidth)
        out[f"b{b}_tps_vs_hf"] = got["tps"] / hf_tps
        if vllm_url:
            v = vllm_decode(vllm_url, [prompt(case.prompt, model.vocab_size, seed=100 + i)
                                       for i in range(b)], case.new)  # fmt: skip
            out.update({f"b{b}_vllm_{k}": x for k, x in v.items()})
            out[f"b{b}_tps_vs_vllm"] = got["tps"] / v["tps"]
    out["python_top_b8"] = python_profile(engine_for(model, case, 8), timer, case)
    out["copy_bandwidth_gbs"] = bandwidth / 1e9
    return {f"{dtype}_{k}": v for k, v in out.items()}


def measure(case: Case, vllm_urls: dict[str, str | None]) -> dict[str, Any]:
    """Every dtype of `vllm_urls` (dtype -> the vLLM server serving that dtype, or None)."""
    report: dict[str, Any] = {
        "threads": torch.get_num_threads(), "kernel_isa": isa(), "matmul_isa": matmul_isa(),
        "prompt": case.prompt, "new": case.new,
    }  # fmt: skip
    for dtype, url in vllm_urls.items():
        report[f"{dtype}_vllm"] = url or "not measured"
        report.update(measure_dtype(dtype, case, url))
    return report


@BENCHES.register("decode")
def bench_decode(
    quick: bool, vllm_url: str | None = None, vllm_bf16_url: str | None = None
) -> dict[str, Any]:
    """SmolLM2-135M, 1024-token prompts, 128 out, batch 1/8/32, fp32 and bf16
    (quick: 64-token prompts, 8 out, batch 1/4); vLLM rows per dtype whose server is given."""
    urls = {"float32": vllm_url, "bfloat16": vllm_bf16_url}
    return measure(QUICK if quick else FULL, urls)

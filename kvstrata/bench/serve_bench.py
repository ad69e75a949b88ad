"""`kvstrata bench serve`: agent sessions through the OpenAI API, cache on vs off, in one run.

Without --url it starts our server twice on a free port (default tiers, then --tiers none) and
drives each with the same sessions; with --url it drives that server (any OpenAI-compatible
engine) twice, the second time with a fresh `cache_salt` per request, so nothing is shared.
Prints TTFT p50/p90/p99, TPOT p50, output tokens/s, hit rate; writes a PNG. Without --url it
also measures the server's overhead: TTFT through HTTP of a full device hit over the engine's own
TTFT for the same prompt tokens (an in-process engine with the same configs), interleaved,
medians; and the same agent load driven straight into that in-process engine (`direct`), HTTP
over direct for TTFT p50 and wall time; and that load once more with the decode-latency target
(`direct_target`: `EngineConfig.tpot_target_ms` = TPOT_TARGET_MS), its TPOT p50 and TTFT p90
over the untargeted run's. Server and baseline use BENCH_THREADS torch threads each.

With --vllm-url (and no --url) it is the comparison with vLLM instead (kvstrata.bench.
serve_replay): a held-out agent trace replayed by vLLM's own benchmark client against that vLLM
server and against our server at equal KV space, with the decode-latency target off and on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstrata.bench.registry import BENCHES
from kvstrata.bench.serve_load import LoadSpec, run_load, session_messages, summarize

QUICK = LoadSpec(sessions=2, turns=3, concurrency=2, first_lines=20, tool_lines=10, max_tokens=8)
FULL = LoadSpec(sessions=8, turns=4, concurrency=4, first_lines=60, tool_lines=30, max_tokens=16)
BENCH_THREADS = 1  # torch threads of the server and of the in-process baseline engine alike
ENGINE_ARGS = [
    "--page-size", "64", "--device-pages", "512", "--host-pages", "1024",
    "--threads", str(BENCH_THREADS),
]  # fmt: skip
OVERHEAD_REPEATS = 5
TPOT_TARGET_MS = 250.0
"""The decode-latency target of the `direct_target` run."""


@BENCHES.register("serve")
def serve_bench(
    quick: bool,
    url: str | None = None,
    sessions: int | None = None,
    concurrency: int | None = None,
    model: str | None = None,
    out: Path | None = None,
    vllm_url: str | None = None,
) -> dict[str, Any]:
    base = QUICK if quick else FULL
    spec = LoadSpec(
        sessions=sessions or base.sessions,
        turns=base.turns,
        concurrency=concurrency or base.concurrency,
        first_lines=base.first_lines,
        tool_lines=base.tool_lines,
        max_tokens=base.max_tokens,
    )
    out_dir = out or Path("kvstrata-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    if vllm_url and not url:
        from kvstrata.bench.serve_replay import replay_vs_vllm
        from kvstrata.engine.build import resolve_model_path
        from kvstrata.engine.config import EngineConfig

        path = resolve_model_path(EngineConfig(model=model or ""))
        return replay_vs_vllm(vllm_url, path, quick, out)
    if vllm_url:
        raise ValueError("--vllm-url compares vLLM with our own server: leave out --url")
    with _progress() as progress:
        if url:
            report = _drive_url(url, spec, progress)
        else:
            report = _drive_ours(model, spec, progress, out_dir)
    report["plot"] = str(_plot(report, out_dir / "bench-serve.png"))
    on, off = report["cache_on"], report["cache_off"]
    report["ttft_p50_off_over_on"] = (
        off["ttft_p50_s"] / on["ttft_p50_s"] if on["ttft_p50_s"] else 0.0
    )
    report["errors"] = on["errors"] + off["errors"]
    for mode, rep in (("on", on), ("off", off)):  # the scalars the table prints
        for key in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "output_tokens_per_s", "hit_rate"):
            report[f"{key}_{mode}"] = rep[key]
    if "device_hit_overhead" in report:
        report["device_hit_http_over_engine"] = report["device_hit_overhead"]["http_over_engine"]
    if "direct" in report:  # the same load straight into an in-process engine
        d = report["direct"]
        report["ttft_p50_http_over_direct"] = on["ttft_p50_s"] / d["ttft_p50_s"]
        report["wall_http_over_direct"] = on["wall_s"] / d["wall_s"]
        t = report["direct_target"]
        for key in ("tpot_p50_s", "ttft_p90_s"):
            report[f"{key}_target"] = t[key]
            report[f"{key}_target_over_off"] = t[key] / d[key] if d[key] else 0.0
    return report


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )


def _ticker(progress: Progress, name: str, spec: LoadSpec) -> Callable[[], None]:
    task = progress.add_task(name, total=spec.sessions * spec.turns)
    return lambda: progress.advance(task)


def _drive_url(url: str, spec: LoadSpec, progress: Progress) -> dict[str, Any]:
    on = run_load(url, None, spec, False, _ticker(progress, "cache on ", spec))
    off = run_load(url, None, spec, True, _ticker(progress, "cache off", spec))
    return {"url": url, "cache_on": summarize(on), "cache_off": summarize(off)}


def _drive_ours(
    model: str | None, spec: LoadSpec, progress: Progress, out_dir: Path
) -> dict[str, Any]:
    from kvstrata.engine.build import resolve_model_path
    from kvstrata.engine.config import EngineConfig
    from kvstrata.serve.process import ServerProcess

    path = resolve_model_path(EngineConfig(model=model or ""))
    args = ["--model", str(path), *ENGINE_ARGS]
    report: dict[str, Any] = {"model": str(path)}
    modes = [("cache_on", ["--tiers", "device_host"]), ("cache_off", ["--tiers", "none"])]
    for mode, extra in modes:
        srv = ServerProcess([*args, *extra], out_dir / f"bench-serve-{mode}.log")
        try:
            res = run_load(srv.url, None, spec, False, _ticker(progress, mode, spec))
            report[mode] = summarize(res)
            if mode == "cache_on":
                report["device_hit_overhead"] = _device_overhead(srv.url, path, spec)
        finally:
            if srv.terminate() != 0:
                raise RuntimeError(f"server ({mode}) did not exit 0; see {srv.log}")
    report["direct"] = _direct(path, spec, progress)
    report["direct_target"] = _direct(path, spec, progress, TPOT_TARGET_MS)
    return report


def _engine(path: Path, tpot_target_ms: float = 0.0) -> Any:
    """The in-process baseline: the server's cache_on configs (ENGINE_ARGS), built alike."""
    from kvstrata.cache.config import CacheConfig
    from kvstrata.engine.build import build_engine
    from kvstrata.engine.config import EngineConfig
    from kvstrata.model.checkpoint import load_model

    cfg = CacheConfig(page_size=64, device_pages=512, host_pages=1024)
    ecfg = EngineConfig(
        model=str(path),
        threads=BENCH_THREADS,
        tpot_target_ms=tpot_target_ms,
    )
    return build_engine(ecfg, cfg, model=load_model(path))


def _direct(
    path: Path, spec: LoadSpec, progress: Progress, tpot_target_ms: float = 0.0
) -> dict[str, Any]:
    """The same agent load with no HTTP in between: the server's overhead on that load
    (`tpot_target_ms`: the engine's decode-latency target; 0 = off, as the server's)."""
    from kvstrata.bench.serve_direct import run_direct
    from kvstrata.model.checkpoint import load_model
    from kvstrata.serve.codec import open_codec

    built = _engine(path, tpot_target_ms)
    name = "direct" + (f" target {tpot_target_ms:g} ms" if tpot_target_ms else "")
    try:
        codec = open_codec(path, load_model(path).vocab_size)
        res = run_direct(built.engine, codec, spec, _ticker(progress, name, spec))
        built.engine.check_integrity()
    finally:
        built.close()
    return summarize(res)


def _device_overhead(url: str, path: Path, spec: LoadSpec) -> dict[str, float]:
    """Full-device-hit TTFT through HTTP vs the engine's own, for the same prompt tokens."""
    import httpx2 as httpx

    from kvstrata.engine.request import Request

    msgs, _ = session_messages(spec, 0)
    tokens = httpx.post(f"{url}/tokenize", json={"messages": msgs}, timeout=60).json()["tokens"]
    built = _engine(path)
    eng = built.engine
    http_s, engine_s = [], []
    try:
        eng.run([Request("warm", list(tokens), 1)])
        _http_ttft(url, tokens)  # the server's copy of the prompt is cached now
        for i in range(OVERHEAD_REPEATS):  # interleaved: both see the same machine load
            req = Request(f"hit{i}", list(tokens), 1)
            eng.run([req])
            engine_s.append(req.ttft_s)
            http_s.append(_http_ttft(url, tokens))
        eng.drain()
    finally:
        built.close()
    h, e = statistics.median(http_s), statistics.median(engine_s)
    return {
        "prompt_tokens": len(tokens),
        "http_ttft_s": h,
        "engine_ttft_s": e,
        "http_over_engine": h / e,
    }


def _http_ttft(url: str, tokens: list[int]) -> float:
    import httpx2 as httpx

    body = {"prompt": tokens, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token chunk in the stream")


def _plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in ("cache_on", "cache_off"):
        ys = report[mode]["ttft_by_turn_s"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=mode)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("kvstrata bench serve: TTFT per turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

"""`kvstrata bench serve --vllm-url URL`: the held-out agent trace replayed by vLLM's own
benchmark client against that vLLM server and against our server, with the decode-latency
target off and on, one after the other in one run.

Equal KV space: our device pool gets vLLM's KV block count and block size (its /metrics
`cache_config_info`), so both hold the same tokens in the space a forward reads; below it our
host tier keeps what the device evicts, while vLLM has nothing below. The trace's histories
together exceed that space (the report gives the ratio), so vLLM recomputes the prefixes it
evicted where ours restores them. Ours runs on THREADS torch threads; start vLLM with as many
OpenMP threads, e.g. `VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 vllm serve MODEL --dtype float32
--block-size 64 --num-gpu-blocks-override 128 --max-model-len 4096 --enforce-eager`.

Order: vLLM, ours (MODES), vLLM again. Reports each run's TTFT p50/p90, TPOT p50/p90, output
tok/s and prefix-cache hit rate (the server's own counters over the run), and ours over the mean
of the two vLLM runs for TTFT p90 and TPOT p50.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import httpx2 as httpx

from kvstrata.bench.vllm_replay_client import replay
from kvstrata.workloads.heldout_trace import TraceSpec, trace_rows, write_trace

QUICK = TraceSpec(sessions=4, turns=2, first_lines=10, tool_lines=5, output_tokens=8)
FULL = TraceSpec()
CONCURRENCY = 4
THREADS = 2
HOST_PAGES = 2048
TPOT_TARGET_MS = 200.0
"""The decode-latency target of the `ours_target` run."""
MODES = (("ours", ()), ("ours_target", ("--tpot-target-ms", str(TPOT_TARGET_MS))))
"""Our server's runs: as it starts by default, then under the decode-latency target."""

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)


def vllm_kv_blocks(url: str) -> tuple[int, int]:
    """(KV blocks, tokens per block) of a running vLLM server, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = _CACHE_INFO.search(text)
    if found is None:
        raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info (not a vLLM server?)")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', found["labels"]))
    return int(labels["num_gpu_blocks"]), int(labels["block_size"])


def prefix_counts(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, tokens found) so far: the server's prefix-cache counters
    (vllm:... or kvstrata:..., summed over label sets)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for kind in total:
            if re.fullmatch(rf"\w+:prefix_cache_{kind}_total(\{{.*\}})?", name):
                total[kind] += float(value.split()[0])
    return total["queries"], total["hits"]


def _run(url: str, tok: Path, data: Path, rows: int, out: Path) -> dict[str, Any]:
    """One replay, with the server's hit rate over it."""
    q0, h0 = prefix_counts(url)
    res = replay(url, tok, data, rows, CONCURRENCY, out)
    q1, h1 = prefix_counts(url)
    res["hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    return res


def replay_vs_vllm(
    vllm_url: str, model_path: Path, quick: bool, out_dir: Path | None
) -> dict[str, Any]:
    """vLLM, ours without and with the target, vLLM again: the same trace, the same client;
    ours over the mean of the two vLLM runs (the machine's load drifts over a run)."""
    from kvstrata.model.tokenizer import Tokenizer

    spec = QUICK if quick else FULL
    out = out_dir or Path(tempfile.mkdtemp(prefix="kvstrata-bench-serve-"))
    tok = Tokenizer(model_path)
    rows = trace_rows(spec, tok.render_chat)
    data = write_trace(out / "heldout-trace.jsonl", rows)
    blocks, block = vllm_kv_blocks(vllm_url)
    last_turn = [len(tok.encode(str(r["prompt"]))) for r in rows[-spec.sessions :]]
    report: dict[str, Any] = {"kv_blocks": blocks, "block_size": block, "requests": len(rows)}
    report["histories_over_kv_space"] = sum(last_turn) / (blocks * block)
    report["vllm"] = _run(vllm_url, model_path, data, len(rows), out / "replay-vllm.json")
    ours = [
        "--model", str(model_path), "--tiers", "device_host", "--page-size", str(block),
        "--device-pages", str(blocks), "--host-pages", str(HOST_PAGES),
        "--threads", str(THREADS),
    ]  # fmt: skip
    for mode, extra in MODES:
        report[mode] = _ours([*ours, *extra], model_path, data, len(rows), out / f"replay-{mode}")
    report["vllm_again"] = _run(vllm_url, model_path, data, len(rows), out / "replay-vllm2.json")
    for key in ("ttft_p90_s", "tpot_p50_s", "hit_rate"):  # the scalars the table prints
        for run in ("vllm", *(m for m, _ in MODES), "vllm_again"):
            report[f"{key}_{run}"] = report[run][key]
    for key in ("ttft_p90_s", "tpot_p50_s"):
        v = (report["vllm"][key] + report["vllm_again"][key]) / 2
        for mode, _ in MODES:
            report[f"{key}_{mode}_over_vllm"] = report[mode][key] / v
    report["tpot_target_ms"] = TPOT_TARGET_MS
    report["out"] = str(out)
    return report


def _ours(args: list[str], model_path: Path, data: Path, rows: int, out: Path) -> dict[str, Any]:
    """Our server with `args`, replayed once (logs and result next to `out`)."""
    from kvstrata.serve.process import ServerProcess

    srv = ServerProcess(args, out.with_suffix(".server.log"))
    try:
        return _run(srv.url, model_path, data, rows, out.with_suffix(".json"))
    finally:
        if srv.terminate() != 0:
            raise RuntimeError(f"our server ({args}) did not exit 0; see {srv.log}")

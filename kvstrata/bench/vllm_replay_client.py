"""vLLM's own benchmark client (`vllm bench serve`, from .venv-vllm) replaying a custom JSONL
dataset against any OpenAI-compatible server, and the figures it reports.

The client sends the rows in file order (`--disable-shuffle`) as text completions
(`--skip-chat-template`: the rows are already chat text), `--max-concurrency` at a time, each
with its row's `output_tokens` (`--custom-output-len -1`; else 256 for every row) and
`ignore_eos`, greedy; before them it sends row 0 once alone, as a test. It measures TTFT from
the request to the first streamed chunk and TPOT per request as (latency - TTFT) / (output
tokens - 1), and saves their mean / median / chosen percentiles (ms) to a JSON file, read back
here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from kvstrata.bench.vllm_client import served_model
from kvstrata.bench.vllm_server import VLLM_BIN

PERCENTILES = (50, 90, 99)
TIMEOUT_S = 3600.0  # one whole replay


def client_command(
    url: str, model: str, tokenizer: Path, dataset: Path, rows: int, concurrency: int, out: Path
) -> list[str]:
    """The `vllm bench serve` command line (the JSON result lands at `out`)."""
    return [
        str(VLLM_BIN), "bench", "serve", "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--disable-shuffle",
        "--skip-chat-template", "--custom-output-len", "-1", "--num-prompts", str(rows),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--save-result",
        "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm",
    ]  # fmt: skip


def replay(
    url: str, tokenizer: Path, dataset: Path, rows: int, concurrency: int, out: Path
) -> dict[str, Any]:
    """Run the client once against `url`; its log goes next to `out` (.log)."""
    cmd = client_command(url, served_model(url), tokenizer, dataset, rows, concurrency, out)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    with out.with_suffix(".log").open("w") as log:
        done = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT_S, check=False
        )
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"vllm bench serve exited {done.returncode}; log: {out}.log")
    return summary(json.loads(out.read_text()))


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one replay, in seconds: TTFT and TPOT at each percentile, tok/s."""
    out: dict[str, Any] = {
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "output_tokens": result["total_output_tokens"],
        "output_tokens_per_s": result["output_throughput"],
        "duration_s": result["duration"],
    }
    for metric in ("ttft", "tpot"):
        out[f"{metric}_mean_s"] = result[f"mean_{metric}_ms"] / 1e3
        for p in PERCENTILES:
            out[f"{metric}_p{p}_s"] = result[f"p{p}_{metric}_ms"] / 1e3
    if result["completed"] == 0 or out["failed"]:
        raise RuntimeError(f"vllm bench serve: {out['failed']} requests failed: {result}")
    return out

"""`kvstrata bench NAME [--json PATH] [--quick]`: run one registered benchmark."""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstrata.bench.registry import load_benches
from kvstrata.cli import validate

BENCH_OPTIONS = (
    "url", "sessions", "concurrency", "model", "out", "vllm_url", "vllm_bf16_url", "trace",
    "replicas", "storage_url", "rate",
)  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark: prints a table, writes JSON")
    p.add_argument("name", help="benchmark name (see --list)", nargs="?")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--quick", action="store_true", help="a smaller, faster version")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    serve = p.add_argument_group("bench serve", "options of the serve benchmark only")
    serve.add_argument("--url", default=None, help="drive this OpenAI-compatible server")
    serve.add_argument("--sessions", type=int, default=None, help="agent sessions")
    serve.add_argument("--concurrency", type=int, default=None, help="sessions at once")
    serve.add_argument(
        "--model", default=None, help="checkpoint our server (serve) or engine (spec) loads"
    )
    serve.add_argument("--out", type=Path, default=None, help="directory of the plot and logs")
    decode = p.add_argument_group(
        "bench decode / serve / prefill", "options of decode, serve and prefill"
    )
    decode.add_argument(
        "--vllm-url", default=None, help="also drive this vLLM server with the same load"
    )
    decode.add_argument(
        "--vllm-bf16-url",
        default=None,
        help="bench decode: a vLLM server of the same checkpoint with --dtype bfloat16, "
        "for the bf16 rows (--vllm-url then serves the fp32 rows)",
    )
    fleet = p.add_argument_group("bench fleet", "options of the fleet benchmark only")
    fleet.add_argument("--replicas", type=int, default=None, help="replicas behind the router")
    fleet.add_argument(
        "--storage-url",
        default=None,
        help="the shared store: a file directory by default; 'mooncake' starts a local master "
        "and holder; a mooncake:// URL is used as given",
    )
    fleet.add_argument("--rate", type=float, default=None, help="requests per second")
    agent = p.add_argument_group("bench agent", "options of the agent benchmark only")
    agent.add_argument(
        "--trace",
        default=None,
        help="the Mooncake trace whose inter-turn gaps the tool calls take (default: "
        "shared/data/mooncake_synthetic_trace.jsonl near the repository)",
    )
    p.set_defaults(func=run)


def _table(name: str, report: dict[str, Any]) -> Table:
    table = Table(title=f"kvstrata bench {name}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        if isinstance(value, int | float | str | bool):
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    return table


def _bench_options(fn: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line that this benchmark takes; others are an error."""
    given = {k: getattr(args, k) for k in BENCH_OPTIONS if getattr(args, k) is not None}
    takes = inspect.signature(fn).parameters
    wrong = [k for k in given if k not in takes]
    if wrong:
        raise ValueError(f"--{wrong[0].replace('_', '-')} is not an option of bench {args.name}")
    for k in ("sessions", "concurrency", "replicas"):
        if k in given and given[k] < 1:
            raise ValueError(f"--{k} must be >= 1, got {given[k]}")
    if "rate" in given and not given["rate"] > 0:
        raise ValueError(f"--rate must be > 0, got {given['rate']}")
    return given


def run(args: argparse.Namespace) -> int:
    benches = load_benches()
    if args.list or not args.name:
        print("\n".join(benches.names()))
        return 0
    validate.check_name(benches, args.name, "NAME")
    validate.check_out_file(args.json, "--json")
    report = benches.create(args.name, args.quick, **_bench_options(benches.get(args.name), args))
    Console().print(_table(args.name, report))
    if args.json:
        args.json.parent.mkdir(exist_ok=True)  # validated: its own parent exists
        args.json.write_text(json.dumps(report, indent=2))
        print(f"report: {args.json}")
    return 0

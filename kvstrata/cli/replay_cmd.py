"""`kvstrata replay TRACE [--json PATH] [--png PATH]`: drive the real cache with a trace."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from kvstrata.bench.replay import ReplayConfig, replay
from kvstrata.bench.report import hit_rate_png, replay_table, write_json
from kvstrata.cache.config import CacheConfig
from kvstrata.configtools import add_config_args
from kvstrata.workloads.generated import AgentConfig, MultiTurnConfig, coding_agent, multi_turn
from kvstrata.workloads.trace import Trace, read_mooncake

GENERATED = {"multi-turn": (MultiTurnConfig, multi_turn), "agent": (AgentConfig, coding_agent)}


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """TRACE argument and trace-reading options shared with `simulate`."""
    p.add_argument(
        "trace",
        help="Mooncake jsonl file, or 'gen:multi-turn' / 'gen:agent' (default generator settings)",
    )
    p.add_argument(
        "--on-error",
        choices=("strict", "skip"),
        default="strict",
        help="malformed trace lines: refuse the file (strict) or skip them (listed with line numbers)",
    )
    p.add_argument(
        "--max-requests", type=int, default=None, help="replay only the first N requests"
    )


def load_trace(args: argparse.Namespace, console: Console) -> Trace:
    if args.trace.startswith("gen:"):
        name = args.trace[4:]
        if name not in GENERATED:
            raise ValueError(f"unknown generator {name!r}; known: {', '.join(GENERATED)}")
        cfg_cls, gen = GENERATED[name]
        trace = gen(cfg_cls())
        if args.max_requests:
            trace.requests = trace.requests[: args.max_requests]
        return trace
    trace = read_mooncake(args.trace, on_error=args.on_error, max_requests=args.max_requests)
    for err in trace.errors[:20]:
        console.print(f"[yellow]skipped[/] {err}")
    if len(trace.errors) > 20:
        console.print(f"[yellow]... and {len(trace.errors) - 20} more skipped lines[/]")
    return trace


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="replay a trace through the real cache: hit rates by tier, bytes moved"
    )
    add_trace_args(p)
    p.add_argument("--json", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--png", type=Path, default=None, help="write the hit-rate-over-time plot here")
    add_config_args(p, CacheConfig)
    add_config_args(p, ReplayConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstrata.configtools import config_from_args

    console = Console(stderr=True)
    cfg = config_from_args(ReplayConfig, args, cache=config_from_args(CacheConfig, args))
    trace = load_trace(args, console)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"replay {len(trace)} requests", total=len(trace))
        result = replay(trace, cfg, lambda n: bar.update(task, completed=n))
    rep = result.report()
    rep["trace"] = trace.source
    rep["skipped_lines"] = len(trace.errors)
    Console().print(replay_table(rep))
    print(
        f"cache work: {rep['tokens_per_s']:,.0f} tokens/s ({rep['prompt_tokens']:,} tokens in {rep['wall_s']:.1f} s)"
    )
    if args.json:
        write_json(rep, args.json)
        print(f"report: {args.json}")
    if args.png:
        hit_rate_png(result.outcomes, args.png, title=f"hit rate over time ({cfg.tiers})")
        print(f"plot: {args.png}")
    return 0

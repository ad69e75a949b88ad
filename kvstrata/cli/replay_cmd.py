"""`kvstrata replay TRACE [--json PATH] [--png PATH]`: drive the real cache with a trace."""

from __future__ import annotations

import argparse
import importlib
import itertools
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from kvstrata.bench.replay import MODEL_MODULES, REPLAY_MODELS, ReplayConfig, replay
from kvstrata.bench.report import hit_rate_png, replay_table, write_json
from kvstrata.cache.config import CacheConfig
from kvstrata.cli import validate
from kvstrata.configtools import add_config_args, config_from_args
from kvstrata.workloads.generated import AgentConfig, MultiTurnConfig, coding_agent, multi_turn
from kvstrata.workloads.trace import DEFAULT_MAX_INPUT_TOKENS, Trace, read_mooncake

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
    p.add_argument(
        "--max-input-tokens",
        type=int,
        default=DEFAULT_MAX_INPUT_TOKENS,
        help="refuse (or skip) trace lines claiming a longer prompt "
        f"(default: {DEFAULT_MAX_INPUT_TOKENS:,})",
    )


def check_trace_args(args: argparse.Namespace) -> None:
    """The trace options: a readable file or a known generator, sane limits."""
    validate.check_min(args.max_requests, "--max-requests", 1)
    validate.check_min(args.max_input_tokens, "--max-input-tokens", 1)
    if args.trace.startswith("gen:"):
        if args.trace[4:] not in GENERATED:
            raise ValueError(
                f"TRACE: unknown generator {args.trace[4:]!r}; known: {', '.join(GENERATED)}"
            )
    elif not Path(args.trace).is_file():
        raise FileNotFoundError(f"TRACE: trace file not found: {args.trace}")


def load_trace(args: argparse.Namespace, console: Console) -> Trace:
    if args.trace.startswith("gen:"):
        name = args.trace[4:]
        if name not in GENERATED:
            raise ValueError(f"unknown generator {name!r}; known: {', '.join(GENERATED)}")
        cfg_cls, gen = GENERATED[name]
        trace = gen(cfg_cls())
        if args.max_requests is not None:
            trace.requests = trace.requests[: args.max_requests]
        return trace
    trace = read_mooncake(
        args.trace,
        on_error=args.on_error,
        max_requests=args.max_requests,
        max_input_tokens=args.max_input_tokens,
    )
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


def _engine_page_nbytes(cfg: ReplayConfig) -> int:
    """KV bytes of one page of the engine model (float32), from its config.json alone."""
    from kvstrata.engine.build import resolve_model_path
    from kvstrata.engine.config import EngineConfig
    from kvstrata.model.checkpoint import parse_spec, read_config

    path = resolve_model_path(EngineConfig(model=cfg.model_path))
    validate.check_checkpoint(path)
    spec = parse_spec(read_config(path))
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * cfg.page_size * 4


def check_replay(args: argparse.Namespace, cfg: ReplayConfig) -> None:
    """Everything `replay` reads or writes, checked before the trace is read."""
    check_trace_args(args)
    for mod in MODEL_MODULES:
        importlib.import_module(mod)
    validate.check_name(REPLAY_MODELS, cfg.model, "--model")
    c = cfg.cache
    validate.check_policies(c.eviction, c.write_policy, c.prefetch_policy)
    if c.storage_url:
        validate.check_storage_url(c.storage_url, "--storage-url")
    validate.check_out_file(args.json, "--json")
    validate.check_out_file(args.png, "--png")
    page = _engine_page_nbytes(cfg) if cfg.model == "engine" else cfg.page_nbytes
    device, host = c.device_pages, c.host_pages
    what = f"{page:,} bytes per page "
    validate.check_memory([("--device-pages", device * page), ("--host-pages", host * page)], what)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    cfg = config_from_args(ReplayConfig, args, cache=config_from_args(CacheConfig, args))
    check_replay(args, cfg)
    trace = load_trace(args, console)
    done = list(itertools.accumulate(r.input_length for r in trace))  # tokens after n requests
    with Progress(console=console, transient=True) as bar:  # by tokens: long lines show as such
        desc = f"replay {len(trace)} requests, {trace.prompt_tokens:,} tokens"
        task = bar.add_task(desc, total=trace.prompt_tokens)
        result = replay(trace, cfg, lambda n: bar.update(task, completed=done[n - 1] if n else 0))
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

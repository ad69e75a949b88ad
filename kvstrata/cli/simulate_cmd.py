"""`kvstrata simulate TRACE --hardware PROFILE [--tp --cp --pp --pd] [--json PATH]`, and with
`--replicas N[,N...] [--routing round_robin,kv_aware]` a fleet of replicas behind the router's
rule (kvstrata/bench/fleet_sim.py) in place of the what-if table."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from kvstrata.bench.costmodel import Topology
from kvstrata.bench.fleet_sim import MAX_REPLICAS, ROUTINGS, fleet_study
from kvstrata.bench.hardware import MODELS, PROFILES, get_model, get_profile
from kvstrata.bench.replay import ReplayConfig
from kvstrata.bench.report import ablation_table, decomposition_table, fleet_table, write_json
from kvstrata.bench.whatif import CostModel, whatif, with_capacities
from kvstrata.cache.config import CacheConfig
from kvstrata.cli import validate
from kvstrata.cli.replay_cmd import add_trace_args, check_trace_args, load_trace


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="what-if TTFT simulation over the real cache, with an ablation table"
    )
    add_trace_args(p)
    p.add_argument(
        "--hardware", required=True, help=f"hardware profile: {', '.join(PROFILES.names())}"
    )
    p.add_argument(
        "--model", default="llama-3.1-8b", help=f"model spec: {', '.join(MODELS.names())}"
    )
    _add_topology_args(p)
    _add_cache_args(p)
    _add_fleet_args(p)
    p.add_argument("--json", type=Path, default=None, help="write the JSON report here")
    p.set_defaults(func=run)


def _add_topology_args(p: argparse.ArgumentParser) -> None:
    """The parallel layout being simulated, and the ablation's other layouts."""
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--cp", type=int, default=1, help="context parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: decode holds the cached prefix, the rest of the KV "
        "goes over RDMA (reports pd_bytes_sent)",
    )
    p.add_argument(
        "--ablate",
        default=None,
        help="topologies of the ablation columns, ';'-separated, e.g. 'tp1;tp4;tp4-cp2;tp4-pd'",
    )


def _add_fleet_args(p: argparse.ArgumentParser) -> None:
    """A fleet of replicas (each the topology above, with its own device and host memory)."""
    p.add_argument(
        "--replicas",
        default=None,
        help=f"simulate a fleet of N replicas sharing the store (comma list, each 1..{MAX_REPLICAS}, "
        "e.g. 1,4,16,64): hit rate and TTFT per routing arm and N, in place of the what-if table",
    )
    p.add_argument(
        "--routing",
        default=",".join(ROUTINGS),
        help=f"with --replicas: the arms, comma list of {', '.join(ROUTINGS)}",
    )


def _fleet_sizes(args: argparse.Namespace) -> list[int]:
    """--replicas as a list (one-line errors naming the option)."""
    try:
        sizes = [int(x) for x in args.replicas.split(",")]
    except ValueError:
        raise ValueError(
            f"--replicas must be comma-separated integers, got {args.replicas!r}"
        ) from None
    for n in sizes:
        if not 1 <= n <= MAX_REPLICAS:
            raise ValueError(f"--replicas: each N must be in 1..{MAX_REPLICAS}, got {n}")
    routings = args.routing.split(",")
    for r in routings:
        if r not in ROUTINGS:
            raise ValueError(f"--routing: unknown arm {r!r}; known: {', '.join(ROUTINGS)}")
    if args.ablate:
        raise ValueError("--ablate is the what-if table's; leave it out with --replicas")
    return sizes


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    """Arrivals, tier capacities and cache policies of the replay."""
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="stretch arrival times (2 = half the request rate)",
    )
    p.add_argument(
        "--device-tokens",
        type=int,
        default=None,
        help="device capacity (default: what HBM holds after weights)",
    )
    p.add_argument(
        "--host-tokens",
        type=int,
        default=None,
        help="host capacity (default: the profile's host DRAM)",
    )
    p.add_argument(
        "--storage-url",
        default="mem",
        help="storage of the device+host+storage row: 'mem' or a storage URL",
    )
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument("--eviction", default="lru", help="eviction policy")
    p.add_argument("--write-policy", default="write_through", help="write policy")
    p.add_argument(
        "--prefetch-policy",
        default="timeout",
        help="storage -> host prefetch policy: best_effort, wait_complete, timeout",
    )


def check_simulate(args: argparse.Namespace) -> None:
    """Names, ranges and paths, before the trace is read."""
    check_trace_args(args)
    validate.check_name(PROFILES, args.hardware, "--hardware")
    validate.check_name(MODELS, args.model, "--model")
    validate.check_policies(args.eviction, args.write_policy, args.prefetch_policy)
    for opt in ("tp", "cp", "pp", "page_size"):
        validate.check_min(getattr(args, opt), "--" + opt.replace("_", "-"), 1)
    for opt in ("device_tokens", "host_tokens"):
        validate.check_min(getattr(args, opt), "--" + opt.replace("_", "-"), 0)
    if not args.time_scale > 0:
        raise ValueError(f"--time-scale must be > 0, got {args.time_scale}")
    if args.storage_url != "mem":
        validate.check_storage_url(args.storage_url, "--storage-url")
    validate.check_out_file(args.json, "--json")
    if args.replicas is not None:
        _fleet_sizes(args)


def _cache(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(
        page_size=args.page_size,
        storage_url="mem://" if args.storage_url == "mem" else args.storage_url,
        eviction=args.eviction,
        write_policy=args.write_policy,
        prefetch_policy=args.prefetch_policy,
    )


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    check_simulate(args)
    hw, model = get_profile(args.hardware), get_model(args.model)
    main = Topology(args.tp, args.cp, args.pp, args.pd)
    cost = CostModel(model, hw, main)  # clear errors for a layout that does not fit, first
    tops = [Topology.parse(t) for t in args.ablate.split(";")] if args.ablate else None
    for t in tops or []:
        t.check(model)
    base = with_capacities(
        ReplayConfig(cache=_cache(args)), cost, args.device_tokens, args.host_tokens
    )
    trace = load_trace(args, console)
    with Progress(console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(row: str, n: int) -> None:
            if row not in tasks:
                tasks[row] = bar.add_task(f"replay {row}", total=len(trace))
            bar.update(tasks[row], completed=n)

        if args.replicas is not None:
            arms = args.routing.split(",")
            rep = fleet_study(
                trace, base, cost, _fleet_sizes(args), arms, args.time_scale, progress
            )
            return _report_fleet(rep, args.json)
        report, _ = whatif(trace, model, hw, main, base, tops, args.time_scale, progress)
    out = Console()
    out.print(decomposition_table(report))
    out.print(ablation_table(report))
    print(f"hit rate {report['hit_rate']:.4f} (ceiling {report['ceiling']:.4f})")
    if main.pd:  # decode holds the hit prefix: only the rest crosses
        sent, ratio = report["pd_bytes_sent"], report["pd_bytes_sent_ratio"]
        print(f"P/D KV bytes sent {sent / 1e9:.3f} GB ({ratio:.4f} of the whole prompts)")
    if args.json:
        write_json(report, args.json)
        print(f"report: {args.json}")
    return 0


def _report_fleet(rep: dict, json_path: Path | None) -> int:
    Console().print(fleet_table(rep))
    if json_path:
        write_json(rep, json_path)
        print(f"report: {json_path}")
    return 0

"""`kvstrata run`: replay the built-in coding-agent workload under none / device / device_host
/ device_host_storage.

Every configuration serves the same prompts with the same model (loaded once); the job checks that
they all generated the same tokens, prints a table, and writes report.json and ttft.png to --out.
All input is validated before anything is written: a bad storage URL, model path or prompt is a
ValueError (one line on stderr, exit 2, via cli/main.py) and the store stays untouched.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstrata.bench.pd_row import PD, check_pd_args, pd_row_by_default, run_pd_row
from kvstrata.bench.run_report import TurnResult, config_report, outputs_identical, write_report
from kvstrata.cache.config import TIER_SETS, CacheConfig
from kvstrata.cli import validate
from kvstrata.cli.storage_options import add_storage_args, storage_config_from_args
from kvstrata.configtools import add_config_args, config_from_args
from kvstrata.engine.build import build_engine, build_speculator, resolve_model_path
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.feed import drive
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM
from kvstrata.model.tokenizer import chat_encoder
from kvstrata.model_parallel.tp import check_layout
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.decision_log import DecisionLog, config_digest, new_run_id
from kvstrata.ranks.group import RankFailure
from kvstrata.ranks.report import requests_report
from kvstrata.ranks.spec import check_spec_layout
from kvstrata.serve.codec import open_codec
from kvstrata.storage.base import StorageConfig, open_storage
from kvstrata.workloads.agent import (
    SessionTurns,
    WorkloadSpec,
    build_workload,
    session_of,
    turn_of,
)

QUICK = WorkloadSpec(sessions=2, turns=3, first_lines=10, tool_lines=6, max_new_tokens=4)
FULL = WorkloadSpec(sessions=2, turns=4, first_lines=100, tool_lines=30, max_new_tokens=8)
STORAGE_PREFIX = "storage-"
PLAIN = "plain"
"""With --spec-draft: one more configuration, no cache and no speculation, whose tokens the
speculative configurations must equal."""
Prompts = list[list[list[int]]]  # [session][turn] -> token ids


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="replay the coding-agent workload under every cache tier set")
    p.add_argument("--quick", action="store_true", help="a small version (about a minute)")
    p.add_argument("--out", type=Path, default=Path("kvstrata-out"), help="report directory")
    p.add_argument("--sessions", type=int, default=None, help="agent sessions (interleaved)")
    p.add_argument("--turns", type=int, default=None, help="turns per session")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per turn")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--prompt", default=None, help="serve this one prompt instead of the workload")
    p.add_argument(
        "--pd",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one more row: router + prefill + decode processes (default: on with one rank)",
    )
    add_config_args(p, EngineConfig)
    add_config_args(p, CacheConfig)  # run serves every tier set (CacheConfig.with_tiers)
    add_storage_args(p, STORAGE_PREFIX)
    add_config_args(p, DistConfig)
    p.set_defaults(func=run)


# ---- validation (nothing is written before these pass) ------------------------------------------
def _spec(args: argparse.Namespace) -> WorkloadSpec:
    base = QUICK if args.quick else FULL
    over = {"sessions": args.sessions, "turns": args.turns, "max_new_tokens": args.max_new_tokens}
    return dataclasses.replace(
        base, seed=args.seed, **{k: v for k, v in over.items() if v is not None}
    )


def _prompts(args: argparse.Namespace, spec: WorkloadSpec, path: Path, model: DecoderLM) -> Prompts:
    tok = chat_encoder(path)
    if args.prompt is None:
        return build_workload(spec, model.vocab_size, tok.encode_chat if tok else None)
    if tok is None:  # tokenizer-less test checkpoints: UTF-8 bytes folded into the vocabulary
        return [[[b % model.vocab_size for b in args.prompt.encode()]]]
    if tok.has_chat_template:  # a base checkpoint continues --prompt as is
        return [[tok.encode_chat(args.prompt)]]
    return [[tok.encode(args.prompt)]]


def _check_prompts(prompts: Prompts, max_new: int, model: DecoderLM, cache: CacheConfig) -> None:
    limit = model.spec.max_position_embeddings
    longest = max(len(p) for s in prompts for p in s)
    if not longest or any(not p for s in prompts for p in s):
        raise ValueError("prompt is empty")
    if longest + max_new > limit:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new} new tokens exceeds the model's {limit} "
            "positions (use fewer --turns or a shorter --prompt)"
        )
    need = -(-(longest + max_new - 1) // cache.page_size)
    if need > cache.device_pages:
        raise ValueError(f"device_pages must be >= {need} (the longest request's pages)")


def _default_device_pages(prompts: Prompts, max_new: int, page: int) -> int:
    """A device pool that must spill: room for the longest request, 3/4 of the sessions' final
    pages, so interleaved sessions evict part of each other's history (host hits) and keep part
    (device hits)."""
    needs = [-(-(len(s[-1]) + max_new - 1) // page) for s in prompts]
    return max(max(needs) + 1, 3 * sum(needs) // 4)


def default_store_url(out: Path) -> str:
    """The store of a run without --storage-url: a file store under its report directory."""
    return f"file://{(out / 'store').resolve()}"


def _configs(args: argparse.Namespace, prompts: Prompts, spec: WorkloadSpec) -> tuple[Any, ...]:
    engine_cfg = config_from_args(EngineConfig, args)
    cache_cfg = config_from_args(CacheConfig, args)
    storage_cfg = storage_config_from_args(args, STORAGE_PREFIX)
    over: dict[str, Any] = {}
    if not cache_cfg.storage_url:
        over["storage_url"] = default_store_url(args.out)
    if args.device_pages is None:
        pages = _default_device_pages(prompts, spec.max_new_tokens, cache_cfg.page_size)
        cp = config_from_args(DistConfig, args).cp
        over["device_pages"] = -(-pages // cp) * cp  # CP shards the pool: a multiple of cp
    return engine_cfg, dataclasses.replace(cache_cfg, **over), storage_cfg


# ---- one configuration ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """One configuration's run, as either launcher takes it."""

    ecfg: EngineConfig
    cache_cfg: CacheConfig
    storage_cfg: StorageConfig
    dist_cfg: DistConfig
    workload: SessionTurns
    model: DecoderLM  # the loaded model (rank processes load their own from its path)
    run_id: str  # this process's: rank 0 draws the ranks'
    on_done: Callable[[], None]  # once per finished request


def run_config(
    tiers: str,
    model: DecoderLM,
    cfgs: tuple[EngineConfig, CacheConfig, StorageConfig],
    dist_cfg: DistConfig,
    prompts: Prompts,
    max_new: int,
    on_done: Callable[[], None] | None = None,
    run_id: str = "",
) -> tuple[list[TurnResult], dict[str, Any] | None]:
    """Serve every session turn by turn (turn k+1 is submitted when turn k finished) on
    dist_cfg's ranks: one in this process (N = 1), or tp x cp x pp local rank processes. The
    sessions interleave, so several requests are in flight and batched together; every rank's
    tokens and accepts agree. on_done: once per finished request (under rank processes: once
    they are done)."""
    engine_cfg, cache_cfg, storage_cfg = cfgs
    tiered = cache_cfg.with_tiers(tiers)
    dist_cfg = _per_config_log(dist_cfg, tiers)
    launch = _in_this_process if dist_cfg.world_size == 1 else _on_rank_processes
    workload = SessionTurns(prompts, max_new)
    tick = on_done or (lambda: None)
    job = Launch(engine_cfg, tiered, storage_cfg, dist_cfg, workload, model, run_id, tick)
    reports = launch(job)
    for key in ("outputs", "spec_accepts"):
        if any(r[key] != reports[0][key] for r in reports):
            raise RuntimeError(f"{tiers}: ranks differ in {key}")
    rank0, results = reports[0], []
    for rid, output in rank0["outputs"].items():  # in the order the requests finished
        s, k = session_of(rid), turn_of(rid)
        hits, ttft = rank0["hits"][rid], rank0["ttft"][rid]
        spec = (tuple(rank0["spec_accepts"][rid]), rank0["spec_proposed"][rid])
        row = (s, k, rid, len(prompts[s][k]), output, hits, ttft, cache_cfg.page_size)
        results.append(TurnResult(*row, *spec))
    return results, rank0["counters"]


def _in_this_process(job: Launch) -> list[dict[str, Any]]:
    """The one rank's report: this process runs it on the loaded model, its own inputs being
    every rank's (identity agreement)."""
    ecfg, cache_cfg, dist_cfg = job.ecfg, job.cache_cfg, job.dist_cfg
    log = None
    if dist_cfg.consensus_log:
        fields = {**dataclasses.asdict(ecfg), **dataclasses.asdict(cache_cfg)}
        log = DecisionLog.from_config(dist_cfg, 0, job.run_id, config_digest(fields))
    built = build_engine(ecfg, cache_cfg, job.storage_cfg, model=job.model, decisions=log)
    eng, done = built.engine, []
    try:
        for result in drive(eng, job.workload):
            done += result.ended
            for _ in result.ended:
                job.on_done()
        eng.drain()
        eng.check_integrity()
        counters = eng.cache.counters.as_dict() if eng.cache is not None else None
    finally:
        built.close()
        if log is not None:
            log.close()
    return [{**requests_report(done), "counters": counters}]


def _on_rank_processes(job: Launch) -> list[dict[str, Any]]:
    """Every rank's report, rank order: tp x cp x pp local rank processes, each loading the
    model from its path (`job.model` and `job.run_id` are this process's: rank 0 draws the
    ranks')."""
    from kvstrata.ranks.rank_engine import (
        run_distributed,  # spawns processes: import only when used
    )

    reports = run_distributed(job.ecfg, job.cache_cfg, job.dist_cfg, job.workload, job.storage_cfg)
    for _ in reports[0]["outputs"]:
        job.on_done()
    return reports


def _per_config_log(dist_cfg: DistConfig, tiers: str) -> DistConfig:
    """Each configuration logs its decisions to its own folder: --consensus-log DIR/<tiers>."""
    if not dist_cfg.consensus_log:
        return dist_cfg
    return dataclasses.replace(dist_cfg, consensus_log=str(Path(dist_cfg.consensus_log) / tiers))


# ---- the job --------------------------------------------------------------------------------------
def _table(configs: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="kvstrata run")
    # the config names (device_host_storage) are never cut: the other columns wrap instead
    table.add_column("config", justify="right", no_wrap=True, min_width=max(map(len, configs)))
    for col in (
        "hit rate",
        "device hit",
        "host hit",
        "storage hit",
        "TTFT p50",
        "TTFT p90",
    ):
        table.add_column(col, justify="right")
    directions = list(next(iter(configs.values()))["bytes_moved"])
    for d in directions:
        table.add_column(f"{d} MB", justify="right")
    spec = any(rep.get("spec") for rep in configs.values())
    pd = any("pd_bytes_sent" in rep for rep in configs.values())
    if pd:
        table.add_column("P/D MB", justify="right")
    if spec:
        table.add_column("accept", justify="right")
        table.add_column("acc len", justify="right")
    for name, rep in configs.items():
        by = rep["hit_rate_by_tier"]
        fig = rep.get("spec")
        extra = [f"{fig['acceptance_rate']:.1%}", f"{fig['accept_length']:.2f}"] if fig else []
        table.add_row(
            name,
            f"{rep['hit_rate']:.1%}",
            *(f"{by[t]:.1%}" for t in ("device", "host", "storage")),
            f"{rep['ttft_p50_s']:.3f}s",
            f"{rep['ttft_p90_s']:.3f}s",
            *(f"{rep['bytes_moved'][d] / 1e6:.1f}" for d in directions),
            *([f"{rep['pd_bytes_sent'] / 1e6:.1f}" if "pd_bytes_sent" in rep else "-"] * pd),
            *(extra or (["-", "-"] if spec else [])),
        )
    return table


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def _check_args(args: argparse.Namespace) -> tuple[EngineConfig, CacheConfig, DistConfig]:
    """Every check that needs no model: names, ranges, ranks, paths, the checkpoint."""
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt is empty")
    for opt in ("sessions", "turns", "max_new_tokens"):
        validate.check_min(getattr(args, opt), "--" + opt.replace("_", "-"), 1)
    validate.check_min(args.threads, "--threads", 0)
    engine_cfg = config_from_args(EngineConfig, args)
    cache_cfg = config_from_args(CacheConfig, args)
    storage_config_from_args(args, STORAGE_PREFIX)  # bad values fail here
    dist_cfg = config_from_args(DistConfig, args)
    validate.check_policies(cache_cfg.eviction, cache_cfg.write_policy, cache_cfg.prefetch_policy)
    validate.check_backend(dist_cfg.backend)
    if args.pd is None:  # the main job's pd row, where its one-rank workers can serve the run
        args.pd = pd_row_by_default(dist_cfg)
    if args.pd:
        check_pd_args(dist_cfg)
    validate.check_out_dir(args.out, "--out")
    if cache_cfg.storage_url:
        create = storage_config_from_args(args, STORAGE_PREFIX).file.create_dir
        validate.check_storage_url(cache_cfg.storage_url, "--storage-url", create)
    store = cache_cfg.storage_url or default_store_url(args.out)
    validate.check_storage_options(args, STORAGE_PREFIX, store)
    validate.check_checkpoint(resolve_model_path(engine_cfg))
    return engine_cfg, cache_cfg, dist_cfg


def _prepare(args: argparse.Namespace) -> tuple[WorkloadSpec, Path, DecoderLM, Prompts, Any]:
    """Check every input, load the model once, build the prompts; then create --out and the
    store (this is the first write)."""
    engine_cfg, cache_cfg, dist_cfg = _check_args(args)
    cache_url = cache_cfg.storage_url
    spec = _spec(args)
    model_path = resolve_model_path(engine_cfg)
    model = load_model(model_path, dtype=engine_cfg.dtype)  # ValueError: not a checkpoint
    prompts = _prompts(args, spec, model_path, model)
    cfgs = _configs(args, prompts, spec)
    shape = model.kv_shape(cfgs[1].page_size)
    check_spec_layout(engine_cfg, dist_cfg)  # an MTP head with --tp > 1: refused here
    if engine_cfg.spec_draft:  # a bad draft fails here, before --out; pages carry its layers
        shape = build_speculator(engine_cfg, model, shape)[1]
    validate.check_engine_memory(model, cfgs[1], dist_cfg.world_size, shape.page_nbytes)
    _check_prompts(prompts, spec.max_new_tokens, model, cfgs[1])
    check_layout(model.spec, dist_cfg.tp, dist_cfg.pp)
    validate.check_ranks(dist_cfg.world_size)
    if cfgs[1].device_pages % dist_cfg.cp:
        raise ValueError(f"--device-pages {cfgs[1].device_pages} must be a multiple of --cp")
    page_nbytes = shape.page_nbytes
    if cfgs[1].storage_url != cache_url:
        args.out.mkdir(exist_ok=True)  # the default store lives under --out
    # the store opens now (an unreachable redis fails here, before --out exists), not mid-run
    open_storage(cfgs[1].storage_url, page_nbytes, cfgs[2]).close()
    args.out.mkdir(exist_ok=True)
    return spec, model_path, model, prompts, cfgs


def _serve_all(
    args: argparse.Namespace,
    console: Console,
    model: DecoderLM,
    prompts: Prompts,
    cfgs: Any,
    max_new: int,
) -> dict[str, tuple[list[TurnResult], dict[str, Any] | None]]:
    """Every configuration over the same workload, on one rank or on tp x cp x pp ranks."""
    n_req = sum(len(s) for s in prompts)
    dist_all = config_from_args(DistConfig, args)
    run_id = new_run_id()
    results: dict[str, tuple[list[TurnResult], dict[str, Any] | None]] = {}
    with _progress(console) as progress:
        for tiers in TIER_SETS:
            task = progress.add_task(f"{tiers:>9}", total=n_req)
            advance = lambda t=task: progress.advance(t)  # noqa: E731
            res = run_config(tiers, model, cfgs, dist_all, prompts, max_new, advance, run_id)
            results[tiers] = res
        if cfgs[0].spec_draft:  # the reference for the identical-outputs check: no speculation
            task = progress.add_task(f"{PLAIN:>9}", total=n_req)
            plain = (dataclasses.replace(cfgs[0], spec_draft=""), *cfgs[1:])
            advance = lambda t=task: progress.advance(t)  # noqa: E731
            one_rank = DistConfig()  # the reference: one rank, nothing logged
            results[PLAIN] = run_config("none", model, plain, one_rank, prompts, max_new, advance)
    return results


def run(args: argparse.Namespace) -> int:
    spec, model_path, model, prompts, cfgs = _prepare(args)
    console = Console()
    if not console.is_terminal:  # logs and pipes: don't squeeze the table into 80 columns
        console = Console(width=170)
    try:
        served = _serve_all(args, console, model, prompts, cfgs, spec.max_new_tokens)
    except RankFailure as exc:  # a rank diverged (live check), raised, died or hung
        for rank, trace in sorted(exc.traces.items()):  # a real error in a rank: its traceback
            print(f"rank {rank} traceback:\n{trace}", file=sys.stderr)
        print(f"kvstrata run: ranks stopped: {exc}", file=sys.stderr)
        return 1
    reports = {tiers: config_report(res, counters) for tiers, (res, counters) in served.items()}
    same = outputs_identical({tiers: res for tiers, (res, _) in served.items()})
    if args.pd:  # the same workload through router + prefill + decode (kvstrata/bench/pd_row.py)
        pd_row = run_pd_row(model_path, cfgs, prompts, spec.max_new_tokens, args.out)
        reports[PD] = pd_row.report()
        decode = open_codec(model_path, model.vocab_size).decode
        same = same and pd_row.same_text(served[PLAIN if PLAIN in served else "none"][0], decode)
    report = {
        "configs": reports,
        "outputs_identical": same,
        "model": str(model_path),
        "workload": dataclasses.asdict(spec),
        "cache": dataclasses.asdict(cfgs[1]),
    }
    json_path, png_path = write_report(report, args.out)
    console.print(_table(reports))
    if same:
        console.print(f"outputs identical across {', '.join(reports)}: yes")
    else:
        console.print("[red]outputs DIFFER between configurations[/red]")
    console.print(f"report: {json_path}\nplot:   {png_path}")
    return 0 if same else 1

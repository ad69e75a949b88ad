"""`kvstrata serve`: an OpenAI-compatible server (see kvstrata/serve/)."""

from __future__ import annotations

import argparse
import dataclasses

from kvstrata.cache.config import CacheConfig
from kvstrata.cli import validate
from kvstrata.cli.run_cmd import STORAGE_PREFIX
from kvstrata.cli.serve_roles import parse_role_args
from kvstrata.cli.storage_options import storage_config_from_args
from kvstrata.cli.tiers_option import apply_tiers_preset
from kvstrata.configtools import config_from_args
from kvstrata.engine.build import resolve_model_path
from kvstrata.engine.config import EngineConfig
from kvstrata.http.config import HttpConfig
from kvstrata.model.checkpoint import load_model
from kvstrata.model_parallel.tp import check_layout
from kvstrata.parent_watch import exit_with_parent
from kvstrata.pd.config import PDConfig
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.spec import check_spec_layout
from kvstrata.router.config import router_config_from_args
from kvstrata.serve.config import ServeConfig
from kvstrata.storage.base import StorageConfig

PARENT_GONE_GRACE_S = 10.0
"""Past stop_timeout_s, how long a server whose launcher died may take to stop by itself."""


def check_pd_ranks(role: str, dist_cfg: DistConfig, engine_cfg: EngineConfig) -> None:
    """What P/D workers on several ranks do not do yet, refused before any rank starts."""
    if role not in ("prefill", "decode") or dist_cfg.world_size == 1:
        return
    if dist_cfg.cp > 1 and dist_cfg.tp * dist_cfg.pp > 1:
        raise ValueError(
            f"--role {role} runs with --tp and --pp ranks, or with --cp alone; not --cp "
            "together with --tp/--pp yet"
        )
    if engine_cfg.spec_draft:  # one-rank P/D workers speculate (tests/test_pd_spec.py)
        raise ValueError(
            f"--role {role} with --spec-draft runs on one rank; not with --tp/--cp/--pp > 1 yet"
        )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server over the cached engine", add_help=False
    )
    p.set_defaults(func=run, parse_with=parse_role_args)  # role R's options only (serve_roles.py)


def configs(args: argparse.Namespace) -> tuple[EngineConfig, CacheConfig, StorageConfig]:
    """Engine, cache and storage configs; the cache's tiers are what its options (or the --tiers
    preset) make: device_host by default, device_host_storage with --storage-url."""
    cache_cfg = config_from_args(CacheConfig, args)
    engine_cfg = config_from_args(EngineConfig, args)
    validate.check_policies(cache_cfg.eviction, cache_cfg.write_policy, cache_cfg.prefetch_policy)
    if cache_cfg.storage_url:
        validate.check_storage_url(cache_cfg.storage_url, "--storage-url")
    validate.check_storage_options(args, STORAGE_PREFIX, cache_cfg.storage_url)
    cache_cfg = apply_tiers_preset(cache_cfg, args)
    return engine_cfg, cache_cfg, storage_config_from_args(args, STORAGE_PREFIX)


def run(args: argparse.Namespace) -> int:
    """One server; under torchrun (RANK / WORLD_SIZE set) rank 0 serves HTTP and steps with
    the other ranks, which only step (`torchrun --nproc-per-node 2 -m kvstrata.cli.main serve
    --tp 2 ...`, world size = tp x cp x pp)."""
    from kvstrata.serve.server import make_state, serve  # fastapi/uvicorn only when serving
    from kvstrata.serve.torchrun import serve_follower, torchrun_rank

    http = config_from_args(HttpConfig, args)
    if http.parent_pid:  # before the model loads: a launcher killed meanwhile leaves nothing
        exit_with_parent(http.parent_pid, http.stop_timeout_s + PARENT_GONE_GRACE_S)
    if args.role == "router":  # no model: the workers have it
        from kvstrata.router.app import serve_router

        return serve_router(router_config_from_args(args))
    cfg = config_from_args(ServeConfig, args, http=http)
    cfgs = configs(args)
    path = resolve_model_path(cfgs[0])
    validate.check_checkpoint(path)
    model = load_model(path, dtype=cfgs[0].dtype)  # ValueError: not a checkpoint
    dist_cfg = config_from_args(DistConfig, args)
    pd_cfg = config_from_args(PDConfig, args)
    check_pd_ranks(cfg.role, dist_cfg, cfgs[0])
    check_layout(model.spec, dist_cfg.tp, dist_cfg.pp)
    check_spec_layout(cfgs[0], dist_cfg)  # on every torchrun rank, before any serves
    if cfgs[1].device_pages % dist_cfg.cp:
        raise ValueError(f"--device-pages {cfgs[1].device_pages} must be a multiple of --cp")
    page_nbytes = model.kv_shape(cfgs[1].page_size).page_nbytes  # a draft's layers add more
    validate.check_engine_memory(model, cfgs[1], dist_cfg.world_size, page_nbytes)
    rank = torchrun_rank(dist_cfg.world_size)  # ValueError: a world size other than tp*cp*pp
    if rank:
        engine_cfg = dataclasses.replace(cfgs[0], model=str(path))
        return serve_follower((engine_cfg, cfgs[1], cfgs[2]), dist_cfg, cfg, pd_cfg)
    return serve(make_state(cfg, model, path, cfgs, dist_cfg, pd_cfg))

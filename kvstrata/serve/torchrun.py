"""Serving under torchrun (env://): which rank this process is, and the ranks other than 0."""

from __future__ import annotations

import os
import signal

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.config import EngineConfig
from kvstrata.ranks.config import DistConfig
from kvstrata.serve.config import ServeConfig
from kvstrata.storage.base import StorageConfig


def torchrun_rank(world_size: int | None = None) -> int | None:
    """This process's global rank when torchrun (or any env:// launcher) started more than one,
    else None. Read when called (never at import): RANK and WORLD_SIZE are what torchrun sets.
    world_size: tp x cp x pp, which must be the launched world size."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    launched = int(os.environ["WORLD_SIZE"])
    if world_size is not None and launched != world_size:
        raise ValueError(
            f"torchrun started {launched} ranks but --tp x --cp x --pp is {world_size}"
        )
    return int(os.environ["RANK"])


def serve_follower(
    configs: tuple[EngineConfig, CacheConfig, StorageConfig],
    dist_cfg: DistConfig,
    serve_cfg: ServeConfig,
    pd_cfg: object = None,
) -> int:
    """A torchrun rank other than 0: no HTTP, the steps rank 0 broadcasts until it says stop.

    Signals are ignored (torchrun passes SIGTERM to every rank; rank 0 stops them all, in step);
    a rank 0 that died is noticed by the next collective, within dist_cfg.timeout_s."""
    from kvstrata.ranks.group import init_ranks, teardown
    from kvstrata.serve.ranks import serve_rank_loop  # (the rank loop imports the engine)

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = init_ranks(dist_cfg)  # env:// (torchrun's MASTER_ADDR / MASTER_PORT / RANK)
    try:
        serve_rank_loop(ctx, *configs, None, None, serve_cfg, pd_cfg)
    finally:
        teardown()
    return 0

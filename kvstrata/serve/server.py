"""Start the server: load the model, build the engine on its thread, run uvicorn until SIGTERM.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and in-flight requests get
`stop_timeout_s` to finish; then they are aborted (their streams end cleanly, finish_reason
"abort", pages released), and the lifespan shutdown stops the engine loop, which drains pending
storage backups and closes the store. Exit 0 when all of that finished.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import uvicorn

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.step_io import Inbox
from kvstrata.http.rules import server_options
from kvstrata.listeners import Listeners
from kvstrata.model.decoder import DecoderLM
from kvstrata.pd.config import PDConfig
from kvstrata.pd.layout import layout_of
from kvstrata.pd.metrics import PDMetrics
from kvstrata.pd.ranks import RankPD
from kvstrata.pd.worker import PDWorker
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.spec import check_spec_layout
from kvstrata.serve.app import create_app
from kvstrata.serve.codec import open_codec
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.loop import LocalRank, LoopFront, LoopParts, Ranks
from kvstrata.serve.metrics import ServeMetrics, engine_stats
from kvstrata.serve.protocol import Limits
from kvstrata.serve.ranks import DistRanks
from kvstrata.serve.state import ServerState
from kvstrata.serve.torchrun import torchrun_rank
from kvstrata.storage.base import StorageConfig

ABORT_GRACE_S = 5.0  # aborted streams' last frames reach the clients within this
DEATH_NOTICE_S = 2.0  # a dead listener: /health says why (503) this long before the port closes


class _Server(uvicorn.Server):
    """uvicorn's server, telling /health that a stop signal arrived (503 from then on).

    uvicorn re-raises a captured signal once it has shut down (so the process dies by it, exit
    143); a graceful stop here is a normal exit, so the signal is not kept for re-raising.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.kv_state = state
        self.abort_timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.kv_state.stopping = True
        if self.abort_timer is None:  # in-flight requests get stop_timeout_s, then are aborted
            loop = self.kv_state.loop
            self.abort_timer = threading.Timer(
                self.kv_state.cfg.http.stop_timeout_s, loop.abort_all
            )
            self.abort_timer.daemon = True
            self.abort_timer.start()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def make_state(
    cfg: ServeConfig,
    model: DecoderLM,
    model_path: Path,
    configs: tuple[EngineConfig, CacheConfig, StorageConfig],
    dist_cfg: DistConfig | None = None,
    pd_cfg: PDConfig | None = None,
) -> ServerState:
    """The server's state; the engine (one rank, or tp x cp x pp ranks) is built by loop.start()."""
    engine_cfg, cache_cfg, storage_cfg = configs
    name = cfg.served_model_name or model_path.name
    metrics = ServeMetrics(name)
    listeners = Listeners(metrics.registry)
    pd = _pd_worker(cfg, pd_cfg, metrics, name)
    ranks: Ranks
    if dist_cfg is not None and dist_cfg.world_size > 1:
        check_spec_layout(engine_cfg, dist_cfg)  # before any rank starts
        engine_cfg = dataclasses.replace(engine_cfg, model=str(model_path))
        under_torchrun = torchrun_rank() is not None  # this process is rank 0 of torchrun's
        ranks = DistRanks((engine_cfg, cache_cfg, storage_cfg), dist_cfg, cfg, under_torchrun, pd)
        # rank 0's latest report (one rank: its engine, read when asked: _build)
        metrics.attach(lambda: loop.stats, cache_cfg.page_size)
    else:
        ranks = LocalRank(lambda inbox: _build(inbox, cfg, metrics, model, configs, pd, listeners))
    loop = LoopFront(cfg.max_pending, ranks)
    loop.observers.append(metrics)  # tokens, endings and pool stats of the loop
    limits = Limits(
        model.vocab_size,
        model.spec.max_position_embeddings,
        cache_cfg.page_size,
        cache_cfg.device_pages,
    )
    codec = open_codec(model_path, model.vocab_size)
    spec = bool(engine_cfg.spec_draft)
    return ServerState(
        cfg,
        loop,
        name,
        str(model_path),
        codec,
        limits,
        metrics,
        spec,
        pd=pd,
        storage_url=cache_cfg.storage_url,
        listeners=listeners,
    )


def _pd_worker(
    cfg: ServeConfig, pd_cfg: PDConfig | None, metrics: ServeMetrics, name: str
) -> PDWorker | None:
    """The HTTP side of a prefill or decode worker (None for single and router); its ranks hold
    their own sides (kvstrata/pd/ranks.py: RankPD, also on one rank)."""
    if cfg.role not in ("prefill", "decode"):
        return None
    return PDWorker(cfg.role, pd_cfg or PDConfig(), PDMetrics(metrics.registry, name))


def _build(
    inbox: Inbox,
    cfg: ServeConfig,
    metrics: ServeMetrics,
    model: DecoderLM,
    configs: tuple[EngineConfig, CacheConfig, StorageConfig],
    pd: PDWorker | None,
    listeners: Listeners,
) -> LoopParts:
    """On the engine thread: pools, storage, cache; the observers that watch the loop; a P/D
    worker's side on this one rank, wired as each rank's is under several (serve/ranks.py)."""
    built = build_engine(*configs, model=model)
    metrics.attach(lambda: engine_stats(built.engine), built.engine.page)
    parts = LoopParts(built)
    if pd is not None:
        side = RankPD(pd.role, pd.cfg, 0, pd.report, inbox, listeners=listeners)
        built.closers.append(side.close)
        try:
            side.attach(built.engine, layout_of(built.engine))
        except BaseException:
            built.close()
            raise
    if cfg.kv_events_endpoint and built.engine.cache is not None:
        from kvstrata.serve.events import KVEventPublisher

        parts.events = KVEventPublisher(cfg, configs[1].page_size, listeners, metrics.registry)
    return parts


def _exit_when_ranks_stop(server: _Server, state: ServerState) -> None:
    """Ranks that stopped (one died, hung or diverged: named in loop.failed) never come back:
    the server stops too, with exit 1, so an orchestrator learns it must restart it."""

    def watch() -> None:
        state.loop.thread.join()  # the ranks' thread ends on a stop or a failure only
        if state.loop.failed and not state.stopping:
            print(f"kvstrata serve: exiting, the ranks stopped: {state.loop.failed}", flush=True)
            state.stopping = True  # /health: 503 until the process is gone
            server.should_exit = True

    threading.Thread(target=watch, name="kvstrata-ranks-watch", daemon=True).start()


def _exit_when_a_listener_dies(server: _Server, state: ServerState) -> None:
    """A listener thread that died (kvstrata/listeners.py) never serves again: /health answers
    503 from then on (state.check_ready), DEATH_NOTICE_S later the server stops as on SIGTERM
    (stop_timeout_s for in-flight requests), exit 1."""

    def stop(why: str) -> None:
        state.stopping = True
        timer = threading.Timer(DEATH_NOTICE_S, server.handle_exit, (signal.SIGTERM, None))
        timer.daemon = True
        timer.start()

    state.listeners.on_death.append(stop)
    if state.listeners.dead is not None:  # died before the server was up
        stop(state.listeners.dead)


def serve(state: ServerState) -> int:
    cfg = state.cfg.http
    app = create_app(state)  # ValueError (a bad API key, ...) before the engine thread starts
    state.loop.start()
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        # after stop_timeout_s our own abort ends every stream cleanly; uvicorn's cancel (which
        # logs a traceback per connection) is only the backstop for a stream that still hangs
        timeout_graceful_shutdown=int(cfg.stop_timeout_s + ABORT_GRACE_S),
        lifespan="on",
        **server_options(cfg.client_timeout_s),
    )
    server = _Server(config, state)
    if state.loop.ranks.fatal_stop:
        _exit_when_ranks_stop(server, state)
    _exit_when_a_listener_dies(server, state)
    where = f"http://{cfg.host}:{cfg.port}"
    print(f"kvstrata serve: {state.model_name} on {where} (pid {os.getpid()})", flush=True)
    server.run()
    if state.loop.thread.is_alive():
        print("kvstrata serve: the engine loop did not stop in time", file=sys.stderr)
        return 1
    if state.loop.failed or state.listeners.dead is not None:
        return 1
    return 0

"""P/D on the HTTP side: GET /v1/pd/info and GET /v1/pd/ranks (counters: metrics.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI

from kvstrata.engine.engine import Engine
from kvstrata.http.paths import PD_INFO_PATH
from kvstrata.pd.layout import layout_of
from kvstrata.pd.ranks import rank_stats
from kvstrata.pd.worker import PDWorker


class EngineCalls(Protocol):
    """What these routes use of the server's step loop (kvstrata.serve.loop.LoopFront)."""

    def local_engine(self) -> Engine | None: ...

    def call(
        self, fn: Callable[[Engine], Any], every_rank: bool = False
    ) -> concurrent.futures.Future[Any]: ...


class ServerView(Protocol):
    """What these routes use of the server's state (kvstrata.serve.state.ServerState)."""

    @property
    def pd(self) -> PDWorker | None: ...

    @property
    def loop(self) -> EngineCalls: ...

    def check_ready(self) -> None: ...


def add_routes(app: FastAPI, state: ServerView) -> None:
    """GET /v1/pd/info on every role (a single server answers role "single")."""

    @app.get(PD_INFO_PATH)
    async def pd_info() -> dict[str, Any]:
        state.check_ready()
        if state.pd is not None:
            return state.pd.info()
        engine = state.loop.local_engine()  # None under ranks: the engine is in rank processes
        return {
            "role": "single",
            "transport": "",
            "transfer_endpoint": "",
            "transfer_endpoints": [],
            "prefill": [],
            "layout": layout_of(engine).as_dict() if engine is not None else None,
        }

    @app.get("/v1/pd/ranks")
    async def pd_ranks() -> dict[str, Any]:
        """A P/D worker on several ranks: each rank's part of a page and its own counters
        (measured on that rank: pages and bytes it sent or received). [] on one rank."""
        state.check_ready()
        if state.pd is None or state.pd.ranks <= 1:
            return {"ranks": []}
        fut = state.loop.call(rank_stats, every_rank=True)
        return {"ranks": await asyncio.wait_for(asyncio.wrap_future(fut), 60.0)}

"""What every route reads: the config, the engine loop, the codec and the model's limits."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvstrata.http.errors import ApiError
from kvstrata.listeners import Listeners
from kvstrata.pd.worker import PDWorker
from kvstrata.serve.codec import Codec
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.loop import LoopFront
from kvstrata.serve.metrics import ServeMetrics
from kvstrata.serve.protocol import Limits


@dataclass
class ServerState:
    cfg: ServeConfig
    loop: LoopFront
    model_name: str
    model_root: str
    codec: Codec
    limits: Limits
    metrics: ServeMetrics
    speculative: bool = False  # --spec-draft set: usage carries each request's `spec`
    stopping: bool = False
    pd: PDWorker | None = None  # the HTTP side of a prefill or decode worker
    listeners: Listeners = field(default_factory=Listeners)  # the process's listener threads
    storage_url: str = ""  # the cache's shared store ("" without one): named in KV events' info
    aloop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)

    def check_ready(self) -> None:
        """503 while the engine builds, after it failed, or while stopping."""
        if self.listeners.dead is not None:
            raise ApiError(503, f"listener thread {self.listeners.dead} died; server is stopping")
        if self.stopping:
            raise ApiError(503, "server is stopping")
        if self.loop.failed is not None:
            raise ApiError(503, f"engine failed to start: {self.loop.failed}")
        if not self.loop.ready.is_set():
            raise ApiError(503, "engine is starting")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist.", "model")

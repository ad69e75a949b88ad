"""Where a request's outputs go on the HTTP side (a Stream), and who watches them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvstrata.serve.request_record import RequestRecord


class QueueFull(Exception):
    """More requests in flight than ServeConfig.max_pending."""


@dataclass
class Stream:
    """Where one request's tokens go: an asyncio queue on the server's event loop."""

    aloop: asyncio.AbstractEventLoop
    received_s: float  # time.monotonic() when the HTTP request arrived
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    last_token_s: float | None = None

    def push(self, kind: str, value: Any) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class LoopObserver:
    """What metrics see of the requests' progress (called where the outputs are handled)."""

    def on_token(self, req: RequestRecord, stream: Stream, now_s: float) -> None: ...

    def on_admitted(self, req: RequestRecord, stream: Stream, now_s: float) -> None: ...

    def on_finished(self, req: RequestRecord, stream: Stream, now_s: float) -> None: ...

    def on_stats(self, stats: Any, agree_s: list[float]) -> None: ...

"""Reads the usage out of a relayed SSE stream as its bytes pass (the fleet's cached-token check).

The bytes go to the client untouched; this keeps only the unfinished event between chunks and
parses the `data:` events that mention "usage" (the last chunk of an OpenAI stream, with
stream_options.include_usage; a stream without it reports nothing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

MAX_PENDING = 1 << 20  # an event longer than this is not a usage chunk: dropped unread


class UsageWatch:
    def __init__(self, on_usage: Callable[[Any], None]) -> None:
        self.on_usage = on_usage
        self.pending = b""

    def __call__(self, chunk: bytes) -> None:
        events = (self.pending + chunk).split(b"\n\n")
        self.pending = events.pop()
        if len(self.pending) > MAX_PENDING:
            self.pending = b""
        for event in events:
            if b'"usage"' in event:
                self._take(event)

    def _take(self, event: bytes) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                body = json.loads(line[5:])
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(body, dict) and body.get("usage"):
                self.on_usage(body["usage"])

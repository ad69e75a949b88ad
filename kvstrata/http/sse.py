"""Server-sent event frames, as the OpenAI streaming API sends them."""

from __future__ import annotations

import json
from typing import Any


def sse(body: dict[str, Any]) -> str:
    """One `data:` event holding `body` as JSON."""
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
"""The last event of every stream."""

"""POST /v1/kv/prefetch: a client says which prompt comes next (an agent whose tool call ended);
GET /debug/pins (with --debug-endpoints): every rank's client pins, to compare.

The body is a completion's or a chat's (`prompt` or `messages`, `cache_salt`). The answer comes
at once: the prompt's full pages each tier holds now (device, host, and what storage holds after
them) and how many pages the hint may read from storage under `--max-prefetch-pages`; the loads
(storage -> host -> device where room) go on in the engine (kvstrata/engine/prefetch_hints.py).
The salt keys the pages as a request's would: a tenant learns of, and moves, only its own.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from kvstrata.cache.keys import key_hex
from kvstrata.engine.engine import Engine
from kvstrata.engine.prefetch_hints import HintAnswer
from kvstrata.serve.generate import prompt_tokens
from kvstrata.serve.protocol import (
    ApiError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    check_tokens,
)
from kvstrata.serve.state import ServerState

PROBE_ANSWER_S = 2.0  # the answer waits this long at most for storage to say what it holds
CALL_TIMEOUT_S = 30.0  # a call waits at most this long for the engine thread

Parse = Callable[[Request, type[BaseModel]], Any]


class PrefetchBody(BaseModel):
    """A completion's or a chat's body: what matters here is the prompt and its salt."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None


def add_kv_hint_routes(app: FastAPI, state: ServerState, parse: Parse) -> None:
    @app.post("/v1/kv/prefetch")
    async def prefetch(request: Request) -> dict[str, Any]:
        body = parse(request, PrefetchBody)
        state.check_ready()
        state.check_model(body.model)
        tokens = _tokens(state, body)
        salt = body.cache_salt or ""
        fut = state.loop.call(functools.partial(start_hint, tokens, salt))
        ans = await asyncio.wait_for(asyncio.wrap_future(fut), CALL_TIMEOUT_S)
        if ans is None:
            return {"pages": {"device": 0, "host": 0, "storage": 0}, "fetch_cap": 0}
        storage = await _storage_found(state, ans) if ans.probing else 0
        return {
            "pages": {"device": ans.device, "host": ans.host, "storage": storage},
            "page_size": state.limits.page_size,
            "fetch_cap": ans.fetch_cap,
        }

    if state.cfg.http.debug_endpoints:

        @app.get("/debug/pins")
        async def pins() -> list[dict[str, Any]]:
            """Every rank's pins (rank order): the pages each keeps, and the prefixes' last keys."""
            state.check_ready()
            fut = state.loop.call(rank_pins, every_rank=True)
            return await asyncio.wait_for(asyncio.wrap_future(fut), CALL_TIMEOUT_S)


def _tokens(state: ServerState, body: PrefetchBody) -> list[int]:
    if body.messages:
        chat = ChatRequest(messages=body.messages)
        tokens, param = prompt_tokens(state, chat), "messages"
    elif body.prompt is not None:
        tokens, param = prompt_tokens(state, CompletionRequest(prompt=body.prompt)), "prompt"
    else:
        raise ApiError(400, "give prompt or messages", "prompt")
    check_tokens(tokens, state.limits, param)
    return tokens


async def _storage_found(state: ServerState, ans: HintAnswer) -> int | None:
    """Storage's answer for the hint, polled between steps (None: not within PROBE_ANSWER_S)."""
    deadline = time.monotonic() + PROBE_ANSWER_S
    while True:
        fut = state.loop.call(functools.partial(hint_storage, ans.hint_id))
        found = await asyncio.wait_for(asyncio.wrap_future(fut), CALL_TIMEOUT_S)
        if found is not None or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.005)


def start_hint(tokens: list[int], cache_salt: str, engine: Engine) -> HintAnswer | None:
    """On every rank between the same steps, at the agreed clock."""
    return engine.kv.hint(tokens, cache_salt, engine.clock())


def hint_storage(hint_id: int, engine: Engine) -> int | None:
    hints = engine.kv.hints
    return hints.storage_found(hint_id) if hints is not None else 0


def rank_pins(engine: Engine) -> dict[str, Any]:
    """This rank's pins: pinned pages, and (pages, last key) of each pinned prefix."""
    cache = engine.cache
    if cache is None:
        return {"pinned": 0, "pins": []}
    book = cache.pins
    ends = sorted([p.pages, key_hex(p.node.keys[-1])] for p in book.pins.values())
    return {"pinned": book.pinned, "pins": ends, "by_tier": book.pages_by_tier()}

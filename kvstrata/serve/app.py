"""The FastAPI app: OpenAI routes, health, metrics, tokenize, and vLLM-shaped errors."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from kvstrata.cache.events import MEDIA, snapshot
from kvstrata.engine.engine import RESET_DRAIN_S, Engine
from kvstrata.http.auth import resolve_api_key
from kvstrata.http.body import json_body
from kvstrata.http.errors import ApiError
from kvstrata.http.rules import add_http_rules
from kvstrata.pd.routes import add_routes as pd_routes
from kvstrata.serve.generate import Generation, choose_prefill, complete, stream
from kvstrata.serve.kv_hint_routes import add_kv_hint_routes
from kvstrata.serve.kv_info import add_routes as kv_info_routes
from kvstrata.serve.protocol import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    TokenIds,
    check_tokens,
)
from kvstrata.serve.state import ServerState

MASK64 = (1 << 64) - 1  # block hashes: low 64 bits of a page key, as KV events send them
MAX_STALL_S = 10.0  # /debug/stall's longest hold (a test's tool, never a hang)
CALL_TIMEOUT_S = 30.0  # a debug call waits at most this long for the engine thread


class TokenizeRequest(BaseModel):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    tokens: TokenIds


def parse(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body as `model`, or a 400 naming the bad field (415 / 413 / 408 / malformed
    JSON: answered before, by the body rules of kvstrata/http/body.py)."""
    try:
        return model.model_validate(json_body(request))
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{field}: {err['msg']}", field) from None


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.aloop = asyncio.get_running_loop()
        yield
        state.stopping = True
        await asyncio.to_thread(state.loop.stop, state.cfg.http.stop_timeout_s + 60.0)

    app = FastAPI(title="kvstrata", lifespan=lifespan)

    http = state.cfg.http
    api_key = resolve_api_key(http.api_key, http.api_key_file)
    add_http_rules(app, api_key, http.max_request_bytes, http.client_timeout_s)

    _info_routes(app, state)
    _generate_routes(app, state)
    _token_routes(app, state)
    _cache_routes(app, state)
    add_kv_hint_routes(app, state, parse)
    pd_routes(app, state)
    kv_info_routes(app, state)
    if state.cfg.http.debug_endpoints:
        _debug_routes(app, state)
    return app


def _info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        try:
            state.check_ready()
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kvstrata",
            "root": state.model_root,
            "max_model_len": state.limits.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _generate_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        return await _generate(state, parse(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Any:
        return await _generate(state, parse(request, ChatRequest), request)


def _token_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse(request, TokenizeRequest)
        if body.messages is not None:
            toks = state.codec.encode_chat(
                [{"role": m.role, "content": m.text()} for m in body.messages]
            )
        elif body.prompt is not None:
            toks = state.codec.encode(body.prompt)
        else:
            raise ApiError(400, "give prompt or messages", "prompt")
        return {"tokens": toks, "count": len(toks), "max_model_len": state.limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse(request, DetokenizeRequest)
        if body.tokens:
            check_tokens(body.tokens, state.limits, "tokens")
        return {"prompt": state.codec.decode(body.tokens)}


def _flag(request: Request, name: str) -> bool:
    """A boolean query parameter (true/false/1/0, absent = false), or a 400 naming it."""
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise ApiError(400, f"{name} must be true or false, got {raw!r}", name)
    return raw in ("true", "1")


def _cache_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict[str, Any]:
        """vLLM's reset: every rank forgets its device pages between the same two steps.

        reset_running_requests=true preempts running requests first (they recompute and go
        on); reset_external=true drops the host copies too. Storage is never touched. As vLLM
        (0.32): 200 with {"success": bool}, false while requests run and hold pages (callers
        may retry); here a false one also says why in "message".
        """
        running, external = (
            _flag(request, "reset_running_requests"),
            _flag(request, "reset_external"),
        )
        state.check_ready()
        fut = state.loop.call(functools.partial(_reset, running, external))
        done = await asyncio.wait_for(asyncio.wrap_future(fut), CALL_TIMEOUT_S + RESET_DRAIN_S)
        if done["reset"]:
            return {"success": True}
        why = (
            f"prefix cache not reset: {done['running']} requests are running and hold pages; "
            "retry once they finish, or pass reset_running_requests=true to preempt them "
            "(they recompute and go on)"
        )
        return {"success": False, "message": why}


def _reset(running: bool, external: bool, engine: Engine) -> dict[str, Any]:
    """On the engine thread (every rank, between the same steps)."""
    busy = engine.queue_depths().running
    return {"reset": engine.reset_prefix_cache(running, external), "running": busy}


def _debug_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/debug/integrity")
    async def integrity() -> dict[str, Any]:
        state.check_ready()
        fut = state.loop.call(_integrity)
        return await asyncio.wait_for(asyncio.wrap_future(fut), CALL_TIMEOUT_S)

    @app.get("/debug/blocks")
    async def blocks() -> dict[str, list[int]]:
        """The cache's own per-medium block hashes (what KV events must add up to)."""
        state.check_ready()
        fut = state.loop.call(_blocks)
        return await asyncio.wait_for(asyncio.wrap_future(fut), CALL_TIMEOUT_S)

    @app.post("/debug/stall")
    async def stall(seconds: float) -> JSONResponse:
        """Holds the engine thread (every rank) for `seconds` between steps, so a test can act
        while no request moves; answers once the hold is queued, ahead of any later request."""
        state.check_ready()
        if not 0 < seconds <= MAX_STALL_S:
            return JSONResponse({"error": f"seconds must be in (0, {MAX_STALL_S}]"}, 400)
        state.loop.call(functools.partial(_stall, seconds))
        return JSONResponse({"queued": seconds}, 202)

    @app.post("/debug/listeners/{name}/kill")
    async def kill_listener(name: str) -> JSONResponse:
        """Makes listener thread `name` (pd-prefill, kv-events-replay) die at its next turn, as
        a fault would: /health goes 503 and the server stops (a test's way to check that)."""
        state.listeners.kill(name)
        return JSONResponse({"killing": name}, 202)


async def _generate(
    state: ServerState, body: CompletionRequest | ChatRequest, request: Request
) -> Any:
    state.check_ready()
    gen = Generation(state, body, await choose_prefill(state, body))
    if body.stream and gen.req.kv_params:
        await gen.wait_first()  # P/D: a failed hand-off gets its status, not a 200 stream
    if body.stream:
        return StreamingResponse(stream(gen), media_type="text/event-stream")
    return await complete(gen, request.is_disconnected)


def _stall(seconds: float, engine: Engine) -> None:
    time.sleep(seconds)


def _blocks(engine: Engine) -> dict[str, list[int]]:
    if engine.cache is None:
        return {m: [] for m in MEDIA}
    held = snapshot(engine.cache.tree)
    return {m: sorted(k & MASK64 for k in keys) for m, keys in held.items()}


def _integrity(engine: Engine) -> dict[str, Any]:
    """Runs on the engine thread: the pools' and tree's invariants, and their accounting."""
    engine.check_integrity()
    cache, depths = engine.cache, engine.queue_depths()
    return {
        "ok": True,
        "running": depths.running,
        "waiting": depths.waiting,
        "held": depths.held,  # ended; pages held for their connector
        "device_free": engine.pool.allocator.num_free,
        "device_capacity": engine.pool.allocator.capacity,
        "accounting": cache.accounting() if cache is not None else None,
        "owned": len(cache.owned) if cache is not None else None,
        "pending_ops": len(cache.queues) if cache is not None else 0,
    }

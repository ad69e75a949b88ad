"""`kvstrata serve --role router`: the OpenAI API of a single server in front of P/D workers.

The router loads no model. Each completion goes to the next decode worker (round robin), which
is told the next prefill worker (upstream.py); the answer comes back as it is: a stream is
relayed chunk by chunk as the bytes arrive (never buffered), a worker's error JSON keeps its
status. A client that goes away closes the upstream connection, so the worker aborts the request.
A decode worker that refuses the connection (nothing was sent) is skipped for down_s and the
request goes to the next one; every worker's /health is probed each health_interval_s, and a
worker that fails it is skipped until it passes again. With no worker of a role left, a request is
a 502, one silent past read_timeout_s a 504, each naming the worker; the client never sees a
traceback. /tokenize, /detokenize and /v1/models are answered by
a decode worker (every worker serves the same model).

With --replicas the router fronts a fleet of data-parallel `kvstrata serve` replicas instead
(kvstrata/router/fleet.py picks each request's replica, replicas.py keeps the routing set and its
index fed): a replica that refuses the connection is left for the next in the rule's order.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx2 as httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstrata.http.auth import ApiKeyGuard, resolve_api_key
from kvstrata.http.errors import ApiError
from kvstrata.http.paths import PD_INFO_PATH
from kvstrata.http.rules import add_http_rules, server_options
from kvstrata.http.sse import sse
from kvstrata.keyfile import read_key_file
from kvstrata.router.config import RouterConfig
from kvstrata.router.fleet import Fleet, Route
from kvstrata.router.fleet_start import make_fleet, start_fleet, use_client
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.upstream import Upstreams
from kvstrata.router.usage_watch import UsageWatch

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is there
JSON = {"content-type": "application/json"}


@dataclass
class RouterState:
    cfg: RouterConfig
    up: Upstreams
    metrics: RouterMetrics
    client: httpx.AsyncClient | None = None
    stopping: bool = False
    api_key: str | None = None  # what clients must send (None: an open router)
    fleet: Fleet | None = None  # with --replicas: the data-parallel fleet (no P/D workers)

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise ApiError(503, "router is starting")
        return self.client


def create_router_app(state: RouterState) -> FastAPI:
    rc = state.up.cfg

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(rc.read_timeout_s, connect=rc.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        headers = state.up.headers  # every worker request carries the workers' API key
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
            state.client = client
            if state.fleet is not None:
                use_client(state.fleet, client)
            watch = asyncio.ensure_future(_watch_health(state))
            try:
                yield
            finally:
                state.stopping = True
                watch.cancel()
                if state.fleet is not None:
                    state.fleet.pool.close()

    app = FastAPI(title="kvstrata router", lifespan=lifespan)
    http = state.cfg.http
    add_http_rules(app, state.api_key, http.max_request_bytes, http.client_timeout_s)

    _info_routes(app, state)
    _generate_routes(app, state)
    if state.fleet is not None and http.debug_endpoints:
        _fleet_debug_routes(app, state.fleet)
    return app


def _fleet_debug_routes(app: FastAPI, fleet: Fleet) -> None:
    @app.get("/debug/fleet/blocks")
    async def blocks() -> dict[str, dict[str, list[int]]]:
        """Per replica in the routing set, the block hashes the index holds per medium (what the
        replica's own /debug/blocks lists once its events are applied)."""
        return {
            r.url: {m: sorted(hs) for m, hs in fleet.index.blocks(r.url).items()}
            for r in fleet.pool.live()
        }


def _info_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 while each role has a healthy worker (the body lists any that are down); else 503
        naming the workers that are not healthy."""
        if state.stopping:
            return JSONResponse(ApiError(503, "router is stopping").body(), status_code=503)
        if state.fleet is not None:
            return _fleet_health(state.fleet)
        bad = await _probe(state)
        roles_left = {role for role, url in state.up.all() if url not in bad}
        if roles_left != {"prefill", "decode"}:
            err = ApiError(503, "workers not healthy: " + "; ".join(bad.values()))
            return JSONResponse(err.body(), status_code=503)
        return JSONResponse({"status": "ok", "down": list(bad.values())})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _forward(state, request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _forward(state, request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _forward(state, request, "POST", "/detokenize")


def _generate_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "/v1/completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await _generate(state, request, "/v1/chat/completions")


async def _probe(state: RouterState) -> dict[str, str]:
    """GET /health of every worker at once; {url: why} of those that failed. A failed worker is
    skipped for down_s, a healthy one taken back at once."""
    client, rc = state.http(), state.up.cfg

    async def one(role: str, url: str) -> str | None:
        try:
            r = await client.get(f"{url}/health", timeout=rc.info_timeout_s)
        except httpx.HTTPError as exc:
            return f"{role} {url}: {type(exc).__name__}"
        if r.status_code != 200:
            return f"{role} {url}: HTTP {r.status_code}"
        # a prefill restarted on the same port has a new transfer endpoint: read it again
        return await _reread_info(state, url) if role == "prefill" else None

    workers = state.up.all()
    found = await asyncio.gather(*(one(role, url) for role, url in workers))
    for (role, url), why in zip(workers, found, strict=True):
        if why is None:
            state.up.pool(role).mark_up(url)
        else:
            state.up.pool(role).mark_down(url, rc.down_s)
    return {url: why for (_, url), why in zip(workers, found, strict=True) if why is not None}


async def _reread_info(state: RouterState, url: str) -> str | None:
    """GET the prefill worker's /v1/pd/info again (one try) and keep its transfer endpoint;
    None when it answered as a prefill worker, else why it cannot be used."""
    rc = state.up.cfg
    if not rc.require_info:
        return None
    try:
        r = await state.http().get(f"{url}{PD_INFO_PATH}", timeout=rc.info_timeout_s)
        body = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        return f"prefill {url}: {PD_INFO_PATH}: {type(exc).__name__}"
    return state.up.take_info("prefill", url, r.status_code, body)


async def _recover(state: RouterState, prefill_url: str) -> str:
    """A hand-off with `prefill_url` failed (decode answered 502/504 before any byte): the
    prefill worker to try once more. Its info is read again: a new transfer endpoint (restarted
    on the same port) means the same worker; otherwise (unreachable, or the same endpoint) the
    next prefill worker not skipped, if there is another, and this one is skipped for down_s."""
    before = state.up.transfer_endpoints(prefill_url)
    why = await _reread_info(state, prefill_url)
    if why is None and state.up.transfer_endpoints(prefill_url) != before:
        state.metrics.handoff_retries.labels(worker=prefill_url, to="same").inc()
        return prefill_url
    state.up.prefill.mark_down(prefill_url, state.up.cfg.down_s)
    others = [u for u in state.up.prefill.order() if u != prefill_url]
    state.metrics.handoff_retries.labels(worker=prefill_url, to="other" if others else "same").inc()
    return others[0] if others else prefill_url


async def _watch_health(state: RouterState) -> None:
    """Probe every health_interval_s until the router stops (cancelled by the lifespan)."""
    while not state.stopping:
        await asyncio.sleep(state.up.cfg.health_interval_s)
        if state.fleet is not None:
            await state.fleet.pool.refresh(state.http())
        else:
            await _probe(state)


def _fleet_health(fleet: Fleet) -> Response:
    """200 while a replica is in the routing set (the body lists those that are not); else 503."""
    down = [url for url, r in fleet.pool.replicas.items() if not r.up]
    if len(down) == len(fleet.pool.replicas):
        why = "; ".join(f"{r.url}: {r.why}" for r in fleet.pool.replicas.values())
        err = ApiError(503, "no replica is up: " + why)
        return JSONResponse(err.body(), status_code=503)
    return JSONResponse({"status": "ok", "down": down})


def _failure(role: str, url: str, exc: httpx.HTTPError, state: RouterState) -> ApiError:
    """The client's error for a worker that failed (the operator's log gets the details)."""
    state.metrics.upstream_errors.labels(role=role, worker=url, kind=type(exc).__name__).inc()
    if isinstance(exc, httpx.TimeoutException):
        limit = state.up.cfg.read_timeout_s
        return ApiError(504, f"{role} worker {url} did not answer within {limit} s")
    return ApiError(502, f"{role} worker {url} unreachable: {type(exc).__name__}: {exc}")


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s answer; if the client goes first, `work` is cancelled (its connection closed,
    so the worker aborts) and the answer is a 499-style empty response nobody reads."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return Response(status_code=499)


async def _forward(state: RouterState, request: Request, method: str, path: str) -> Response:
    """A plain request to the next decode worker (a fleet: a live replica); its answer (status
    and body) as it is."""
    url = state.fleet.live()[0].url if state.fleet is not None else state.up.decode.pick()
    body = await request.body() if method == "POST" else None
    try:
        r = await state.http().request(method, f"{url}{path}", content=body, headers=JSON)
    except httpx.HTTPError as exc:
        raise _failure("decode", url, exc, state) from None
    return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))


def _decode_content(state: RouterState, raw: bytes, prefill_url: str) -> tuple[bytes, bool]:
    """(what decode is sent, whether the client asked for a stream). A body that is not a JSON
    object goes as it is: the worker answers it with its own 400 (one validation rule)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw, False
    if not isinstance(body, dict):
        return raw, False
    content = json.dumps(state.up.decode_body(body, prefill_url)).encode()
    return content, body.get("stream") is True


async def _open(
    state: RouterState, path: str, raw: bytes, prefill_url: str
) -> tuple[httpx.Response, str, bool]:
    """(decode's answer, opened as a stream; its worker; whether the client wants a stream). A
    worker that refuses the connection got nothing, so the next one is tried (each at most once)."""
    client = state.http()
    content, streaming = _decode_content(state, raw, prefill_url)
    refused: list[ApiError] = []
    for decode_url in state.up.decode.order():
        send = client.build_request("POST", f"{decode_url}{path}", content=content, headers=JSON)
        try:
            resp = await client.send(send, stream=True)
        except httpx.ConnectError as exc:
            refused.append(_failure("decode", decode_url, exc, state))
            state.up.decode.mark_down(decode_url, state.up.cfg.down_s)
            continue
        except httpx.HTTPError as exc:
            raise _failure("decode", decode_url, exc, state) from None
        state.metrics.requests.labels(role="decode", worker=decode_url).inc()
        state.metrics.requests.labels(role="prefill", worker=prefill_url).inc()
        return resp, decode_url, streaming
    if len(refused) == 1:
        raise refused[0]
    raise ApiError(502, "every decode worker refused: " + "; ".join(e.message for e in refused))


async def _handoff_failed(state: RouterState, resp: httpx.Response) -> bool:
    """Nothing reached the client and decode's hand-off with the prefill worker failed: a
    502/504 before any byte (P/D workers answer a failed hand-off so, never a relayed stream),
    or a 403 on pd_prefill (the endpoint sent is no longer one of decode's prefill workers':
    that worker restarted on a new one)."""
    if not state.up.cfg.require_info or resp.status_code not in (403, 502, 504):
        return False
    if resp.status_code != 403:
        return True
    await resp.aread()  # a short JSON error
    try:
        return bool(resp.json()["error"]["param"] == "pd_prefill")
    except (ValueError, KeyError, TypeError):
        return False


async def _read_whole(state: RouterState, resp: httpx.Response, role: str, url: str) -> bytes:
    """A worker's whole (non-streamed) answer; the connection closed in any case."""
    try:
        return await resp.aread()
    except httpx.HTTPError as exc:
        raise _failure(role, url, exc, state) from None
    finally:
        await resp.aclose()


async def _generate(state: RouterState, request: Request, path: str) -> Response:
    if state.fleet is not None:
        return await _generate_fleet(state, state.fleet, request, path)
    prefill_url, raw, t0 = state.up.prefill.pick(), await request.body(), time.perf_counter()

    async def open_and_answer() -> Response:
        resp, decode_url, streaming = await _open(state, path, raw, prefill_url)
        if await _handoff_failed(state, resp):  # nothing reached the client yet: one more try
            await resp.aclose()
            retry_url = await _recover(state, prefill_url)
            resp, decode_url, streaming = await _open(state, path, raw, retry_url)
        if resp.status_code == 200 and streaming:
            relay = _relay(resp, decode_url, state, t0)
            return StreamingResponse(relay, media_type="text/event-stream")
        data = await _read_whole(state, resp, "decode", decode_url)
        state.metrics.observe_whole(resp.status_code, time.perf_counter() - t0)
        kind = resp.headers.get("content-type")
        return Response(data, status_code=resp.status_code, media_type=kind)

    return await _unless_disconnected(request, open_and_answer())


async def _relay(
    resp: httpx.Response,
    url: str,
    state: RouterState,
    t0: float,
    watch: Callable[[bytes], None] | None = None,
) -> AsyncIterator[bytes]:
    """The worker's SSE bytes as they arrive (each also shown to `watch`). A cut stream ends
    with an error event (the OpenAI clients raise it) instead of a silent end; closing here
    aborts the worker's request."""
    first = True
    try:
        async for chunk in resp.aiter_raw():
            if first:
                state.metrics.ttft.observe(time.perf_counter() - t0)
                first = False
            if watch is not None:
                watch(chunk)
            yield chunk
        state.metrics.e2e.observe(time.perf_counter() - t0)
    except httpx.HTTPError as exc:
        err = _failure("decode", url, exc, state)
        yield sse(err.body()).encode()
    finally:
        with anyio.CancelScope(shield=True):  # also on a client disconnect (cancellation)
            await resp.aclose()


async def _open_replica(
    state: RouterState, fleet: Fleet, path: str, raw: bytes, route: Route
) -> tuple[httpx.Response, str]:
    """(the replica's answer, opened as a stream; that replica). One that refuses the connection
    got nothing, so the next in the route's order is tried (each at most once)."""
    client, refused = state.http(), []
    for url in route.order:
        send = client.build_request("POST", f"{url}{path}", content=raw, headers=JSON)
        try:
            resp = await client.send(send, stream=True)
        except httpx.ConnectError as exc:
            refused.append(_failure("replica", url, exc, state))
            fleet.refused(url)
            continue
        except httpx.HTTPError as exc:
            raise _failure("replica", url, exc, state) from None
        state.metrics.requests.labels(role="replica", worker=url).inc()
        fleet.started(url, route)
        return resp, url
    if len(refused) == 1:
        raise refused[0]
    raise ApiError(502, "every replica refused: " + "; ".join(e.message for e in refused))


async def _generate_fleet(
    state: RouterState, fleet: Fleet, request: Request, path: str
) -> Response:
    raw, t0 = await request.body(), time.perf_counter()

    async def open_and_answer() -> Response:
        route = await fleet.route(state.http(), raw, request.headers)
        resp, url = await _open_replica(state, fleet, path, raw, route)
        if resp.status_code == 200 and resp.headers.get("content-type", "").startswith(
            "text/event-stream"
        ):
            watch = UsageWatch(lambda usage: fleet.observe(route, url, usage))
            relay = _relay(resp, url, state, t0, watch)
            return StreamingResponse(
                _after(relay, lambda: fleet.finished(url)), media_type="text/event-stream"
            )
        try:
            data = await _read_whole(state, resp, "replica", url)
        finally:
            fleet.finished(url)
        fleet.observe_body(route, url, data)
        state.metrics.observe_whole(resp.status_code, time.perf_counter() - t0)
        return Response(
            data, status_code=resp.status_code, media_type=resp.headers.get("content-type")
        )

    return await _unless_disconnected(request, open_and_answer())


async def _after(chunks: AsyncIterator[bytes], done: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        done()


class _Server(uvicorn.Server):
    """A graceful SIGTERM stop is a normal exit (uvicorn would re-raise the signal)."""

    def __init__(self, config: uvicorn.Config, state: RouterState) -> None:
        super().__init__(config)
        self.router_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.router_state.stopping = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def serve_router(rcfg: RouterConfig) -> int:
    """Check the workers' roles (bounded), then serve until SIGTERM. Exit 0 on a clean stop."""
    cfg = rcfg.http
    api_key = resolve_api_key(cfg.api_key, cfg.api_key_file)
    worker_key = (
        read_key_file(rcfg.worker_api_key_file, "--router-worker-api-key-file")
        if rcfg.worker_api_key_file
        else api_key
    )
    up = Upstreams(rcfg, ApiKeyGuard.header(worker_key) if worker_key else {})
    metrics = RouterMetrics(rcfg.served_model_name or "router")
    fleet = make_fleet(rcfg, metrics.registry) if rcfg.fleet else None
    if fleet is None:
        up.check_roles()
    else:
        start_fleet(fleet, up.headers)
    state = RouterState(rcfg, up, metrics, api_key=api_key, fleet=fleet)
    config = uvicorn.Config(
        create_router_app(state),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        timeout_graceful_shutdown=int(cfg.stop_timeout_s),
        lifespan="on",
        **server_options(cfg.client_timeout_s),
    )
    workers = ", ".join(f"{r} {u}" for r, u in up.all()) or f"{rcfg.routing}: " + ", ".join(
        rcfg.replicas
    )
    print(f"kvstrata serve: router on http://{cfg.host}:{cfg.port} ({workers})", flush=True)
    _Server(config, state).run()
    return 0

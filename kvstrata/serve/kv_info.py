"""GET /v1/kv/events/info: what a fleet router needs to index this server's pages.

A router (`kvstrata serve --role router --replicas ...`) reads it once per replica start: the KV
event sockets to subscribe to (as configured: a wildcard host such as `tcp://*:5557` is for the
router to replace with the replica's own host), the payload format and topic, whether the sockets
are CURVE servers and their public key, and the inputs of this server's page keys (the namespace
kvstrata.cache.keys chains every prompt under, the request's cache_salt joining it by
kvstrata.cache.keys.salted), so the router computes a prompt's block hashes exactly as this server
does. `storage` names the shared store (a digest of its URL, never the URL: it may hold a
password): replicas with the same one read each other's stored pages. `tenant_salt` is part of
the namespace, so the route sits behind --api-key like every path but /health and /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import xxhash
import zmq.auth
from fastapi import FastAPI

from kvstrata.engine.engine import Engine
from kvstrata.http.errors import ApiError
from kvstrata.http.paths import KV_EVENTS_INFO_PATH
from kvstrata.serve.state import ServerState

CALL_TIMEOUT_S = 30.0  # the engine thread answers between two steps


def storage_id(url: str) -> str:
    """A shared store's name in the info: a digest of its URL ("" without storage)."""
    return xxhash.xxh64_hexdigest(url.encode()) if url else ""


def curve_public(secret_file: str) -> str | None:
    """The z85 public key of a CURVE secret key file (None without CURVE)."""
    if not secret_file:
        return None
    public, _ = zmq.auth.load_certificate(secret_file)
    return public.decode()


def _namespace(engine: Engine) -> dict[str, Any]:
    """On the engine thread: the namespace every page key of this server chains under."""
    return dataclasses.asdict(engine.kv.ns)


def add_routes(app: FastAPI, state: ServerState) -> None:
    cfg = state.cfg

    @app.get(KV_EVENTS_INFO_PATH)
    async def kv_events_info() -> dict[str, Any]:
        if not cfg.kv_events_endpoint:
            raise ApiError(404, "this server publishes no KV events (--kv-events-endpoint)")
        state.check_ready()
        fut = state.loop.call(_namespace)
        namespace = await asyncio.wait_for(asyncio.wrap_future(fut), CALL_TIMEOUT_S)
        return {
            "endpoint": cfg.kv_events_endpoint,
            "replay_endpoint": cfg.kv_events_replay_endpoint or None,
            "format": cfg.kv_events_format,
            "topic": cfg.kv_events_topic,
            "curve": bool(cfg.kv_events_curve_secret_file),
            "curve_server_key": curve_public(cfg.kv_events_curve_secret_file),
            "page_size": state.limits.page_size,
            "namespace": namespace,
            "storage": storage_id(state.storage_url),
        }

"""Installs the HTTP rules on an app and its uvicorn server: the same calls in `kvstrata serve`
(every role, so the P/D routes too) and the router, so no server we ship has other rules."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from kvstrata.http.auth import ApiKeyGuard
from kvstrata.http.body import JsonBodies
from kvstrata.http.errors import add_error_handlers
from kvstrata.http.slow_clients import with_headers_timeout


def add_http_rules(
    app: FastAPI, api_key: str | None, max_request_bytes: int, client_timeout_s: float
) -> None:
    """Error handlers (vLLM's error JSON), then the middlewares, outermost first: the API key
    (no body is read for a client without it), then the JSON body rules (body.JsonBodies)."""
    add_error_handlers(app)
    app.add_middleware(JsonBodies, max_bytes=max_request_bytes, timeout_s=client_timeout_s)
    if api_key is not None:  # added last: Starlette runs the last added middleware first
        app.add_middleware(ApiKeyGuard, api_key=api_key)


def server_options(client_timeout_s: float) -> dict[str, Any]:
    """uvicorn.Config options: a connection gets client_timeout_s to send each request's
    headers (slow_clients.py); an idle keep-alive connection closes after uvicorn's 5 s."""
    return {"http": with_headers_timeout(client_timeout_s)}

"""API-key authentication of the HTTP server (vLLM's `--api-key`: `Authorization: Bearer KEY`).

An ASGI middleware, not a route dependency, so no route (present or future, P/D included) can be
added without it. /health and /metrics stay open, as in vLLM: orchestrators and Prometheus probe
them without credentials. Every other path answers 401 in vLLM's error shape without a key.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from kvstrata.http.errors import ApiError
from kvstrata.keyfile import check_key_text, read_key_file

OPEN_PATHS = frozenset({"/health", "/metrics"})
API_KEY_ENV = "KVSTRATA_API_KEY"
"""Read at server start (never at import) when neither --api-key nor --api-key-file is given."""


def resolve_api_key(api_key: str, api_key_file: str) -> str | None:
    """The key the server requires, or None (open server). ValueError naming the option: an
    empty key, or one with leading or trailing whitespace (a client would never match it)."""
    if api_key and api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file:
        return read_key_file(api_key_file, "--api-key-file")
    if api_key:
        return check_key_text(api_key, "--api-key")
    from_env = os.environ.get(API_KEY_ENV)
    return check_key_text(from_env, f"${API_KEY_ENV}") if from_env else None


class ApiKeyGuard:
    """ASGI middleware: every HTTP path but OPEN_PATHS needs `Authorization: Bearer <key>`."""

    @staticmethod
    def header(api_key: str) -> dict[str, str]:
        """What a client (the router, decode) sends a keyed server."""
        return {"Authorization": f"Bearer {api_key}"}

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = ApiError(
            401, "Unauthorized: send the server's API key as 'Authorization: Bearer KEY'"
        )
        await err.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)  # constant time: no key by timing

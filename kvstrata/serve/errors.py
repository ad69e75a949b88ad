"""The error answers every kvstrata HTTP app gives (server and router): vLLM's error JSON."""

from __future__ import annotations

import sys
import traceback

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvstrata.serve.protocol import ApiError


def add_error_handlers(app: FastAPI) -> None:
    """An ApiError answers with its status and body; anything else is a one-line 500 (the
    traceback goes to the operator's log, never to the client)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exc(file=sys.stderr)
        err = ApiError(500, f"internal error: {type(exc).__name__}")
        return JSONResponse(err.body(), status_code=500)

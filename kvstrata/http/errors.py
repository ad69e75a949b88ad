"""The error answers every kvstrata HTTP app gives (server and router): vLLM's error JSON."""

from __future__ import annotations

import sys
import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error answered in vLLM's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @property
    def kind(self) -> str:
        kinds = {
            400: "BadRequestError",
            401: "UnauthorizedError",
            403: "PermissionDeniedError",
            404: "NotFoundError",
            408: "RequestTimeoutError",
            413: "RequestEntityTooLargeError",
            415: "UnsupportedMediaTypeError",
            502: "BadGatewayError",
            503: "ServiceUnavailableError",
            504: "GatewayTimeoutError",
        }
        return kinds.get(self.status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """This error as a response (an ASGI app: a middleware answers with it directly)."""
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """An ApiError answers with its status and body; anything else is a one-line 500 (the
    traceback goes to the operator's log, never to the client)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exc(file=sys.stderr)
        return ApiError(500, f"internal error: {type(exc).__name__}").response()

"""JSON request bodies, one rule for every app we ship (server, router, P/D workers): JSON
content type only, bounded size, read within a deadline, any malformed JSON a 400 (never a 500
or a dropped connection).

Why each rule: a `text/plain` (or untyped) POST is what a web page in the operator's browser may
send cross-origin without a CORS preflight, so only a JSON content type is parsed (415 otherwise);
a declared Content-Length over the cap is refused before any byte is read, and a chunked body is
counted as it arrives and refused as soon as it passes the cap (413), so a huge body never grows
the process; a body that trickles in is cut at the deadline (408), so a slow client cannot hold a
connection; json.loads raises RecursionError on deep nesting and ValueError on integers past
Python's digit limit, and accepts lone UTF-16 surrogates that would fail later in the tokenizer:
all three are 400s here.

The middleware reads and checks the body once; a route takes the object with `json_body` (the
raw bytes stay readable, replayed to the app, for a route that forwards them).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request

from kvstrata.http.errors import ApiError

JSON_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/kv/prefetch"}
)
"""The routes whose body is one JSON object (every other route reads no body)."""
_STATE_KEY = "kvstrata_json_body"  # where the middleware leaves the parsed object (scope state)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff, paired or lone
_CLOSE = {"Connection": "close"}


class JsonBodies:
    """ASGI middleware: a POST to a JSON_PATHS route reaches the app only with a JSON content
    type (415), at most max_bytes of body (413, counted as it arrives), read within timeout_s of
    its headers (408), holding one well-formed JSON object of valid Unicode text (400)."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in JSON_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            raw = await self._read(scope, receive)
        except ApiError as err:  # 415 / 413 / 408: the body's unread rest ends the connection
            await err.response(_CLOSE)(scope, receive, send)
            return
        if raw is None:  # the client went away mid-body: nobody to answer
            return
        try:
            scope.setdefault("state", {})[_STATE_KEY] = parse_json_object(raw)
        except ApiError as err:
            await err.response()(scope, receive, send)
            return
        await self.app(scope, _replay(raw, receive), send)

    async def _read(self, scope: dict[str, Any], receive: Any) -> bytes | None:
        """The whole body (None if the client disconnected), or the ApiError refusing it."""
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").decode("latin-1")
        if not is_json_type(ctype):
            got = repr(ctype) if ctype else "none"
            raise ApiError(
                415, f"the body must be JSON with Content-Type: application/json, got {got}"
            )
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise _too_large(int(declared), self.max_bytes)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await _read_capped(receive, self.max_bytes)
        except TimeoutError:
            raise ApiError(
                408, f"request body not received within {self.timeout_s} s (--client-timeout-s)"
            ) from None


async def _read_capped(receive: Any, max_bytes: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(raw: bytes, receive: Any) -> Any:
    """A receive that gives the app the body already read, then the client's own messages
    (a disconnect)."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return replayed


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(
        413, f"request body of {size}+ bytes is over the limit of {max_bytes} (--max-request-bytes)"
    )


def is_json_type(content_type: str) -> bool:
    """application/json or a +json type, with any parameters (charset=...)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, as JsonBodies checked it (a route of JSON_PATHS only)."""
    state = request.scope.get("state", {})
    if _STATE_KEY not in state:
        raise RuntimeError(f"{request.url.path}: no JSON body (JsonBodies not installed?)")
    return state[_STATE_KEY]


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object; 400 for anything that is not one well-formed JSON object of valid
    Unicode text."""
    if not raw.strip():
        raise ApiError(400, "the body is empty: send one JSON object")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError; so is
        raise ApiError(400, f"malformed JSON body: {exc}") from None  # the int digit limit
    if not isinstance(data, dict):
        raise ApiError(400, "the JSON body must be an object")
    if _SURROGATE_ESCAPE.search(raw):  # only then can a decoded string hold a lone surrogate
        _check_text(data)
    return data


def _check_text(value: Any) -> None:
    """400 if any string (key or value) holds a lone surrogate (not valid Unicode text)."""
    stack = [value]
    while stack:  # iterative: json.loads already bounded the depth, this must not recurse
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(
                    400, "malformed JSON body: a string holds a lone surrogate"
                ) from None

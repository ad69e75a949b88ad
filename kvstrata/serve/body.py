"""Reading a JSON request body safely: JSON content type only, bounded size, any malformed
JSON a 400 (never a 500 or a dropped connection).

Why each rule: a `text/plain` (or untyped) POST is what a web page in the operator's browser may
send cross-origin without a CORS preflight, so only a JSON content type is parsed (415 otherwise);
a declared Content-Length over the cap is refused before any byte is read, and a chunked body is
counted as it arrives and refused as soon as it passes the cap (413); json.loads raises
RecursionError on deep nesting and ValueError on integers past Python's digit limit, and accepts
lone UTF-16 surrogates that would fail later in the tokenizer: all three are 400s here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request

from kvstrata.serve.protocol import ApiError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff, paired or lone


def is_json_type(content_type: str) -> bool:
    """application/json or a +json type, with any parameters (charset=...)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or 413 once it is known to exceed max_bytes (without reading the rest)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(
        413, f"request body of {size}+ bytes is over the limit of {max_bytes} (--max-request-bytes)"
    )


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object: 415 unless the content type is JSON, 413 over the size cap,
    400 for anything that is not one well-formed JSON object of valid Unicode text."""
    ctype = request.headers.get("content-type", "")
    if not is_json_type(ctype):
        got = repr(ctype) if ctype else "none"
        raise ApiError(415, f"the body must be JSON with Content-Type: application/json, got {got}")
    raw = await read_body(request, max_bytes)
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

"""Slow clients (slowloris): a connection must finish its request's headers within a deadline.

uvicorn closes a keep-alive connection that stays silent, but a client that sends one byte a
second is never silent and, while its headers are incomplete, no ASGI app runs to stop it: one
such client per connection slot holds the server. So the HTTP/1.1 protocol here waits for a
request's headers at most `headers_timeout_s` from the moment the connection opens (or its last
response ends), then answers 408 and closes the connection. The body has its own deadline, in
the app (body.JsonBodies): once the headers are in, an ASGI app runs and can bound its reads.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from kvstrata.http.errors import ApiError


class HeadersDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are late."""

    headers_timeout_s: ClassVar[float] = 60.0  # set per server by `with_headers_timeout`

    def connection_made(self, transport: Any) -> None:
        self.headers_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._wait_for_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may already start a pipelined request's cycle
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.headers_deadline is not None:
            self.headers_deadline.cancel()
        super().connection_lost(exc)

    def _wait_for_headers(self) -> None:
        """Arm the deadline: it closes the connection unless a new request cycle (the next
        request's headers complete) has begun by then."""
        if self.headers_deadline is not None:
            self.headers_deadline.cancel()
        waited_since = self.cycle  # None, or the cycle that just completed
        self.headers_deadline = self.loop.call_later(
            self.headers_timeout_s, self._expire, waited_since
        )

    def _expire(self, waited_since: Any) -> None:
        if self.cycle is not waited_since or self.transport.is_closing():
            return  # a request came in time (the deadline is re-armed when it is answered)
        self.transport.write(timeout_reply(self.headers_timeout_s))
        self.transport.close()


def timeout_reply(timeout_s: float) -> bytes:
    """A whole 408 response (written to the socket: no h11 request cycle exists to send it)."""
    err = ApiError(408, f"request headers not received within {timeout_s} s (--client-timeout-s)")
    body = json.dumps(err.body()).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def with_headers_timeout(timeout_s: float) -> type[HeadersDeadline]:
    """The protocol class for a server whose clients get `timeout_s` to send their headers."""
    return type("HeadersDeadline", (HeadersDeadline,), {"headers_timeout_s": timeout_s})

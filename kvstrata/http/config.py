"""Configuration of an HTTP listener we ship: address, client key, request limits, graceful stop.

Both `kvstrata serve` (ServeConfig, which adds the model server's fields) and the router
(`kvstrata serve --role router`, which adds RouterConfig beside it) listen with these fields, so
their options, defaults and checks are written once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.configtools import doc, require_positive


@dataclass(frozen=True)
class HttpConfig:
    """HTTP listener: address, API key, request limits, graceful stop."""

    host: str = doc("127.0.0.1", "address to listen on")
    port: int = doc(8000, "TCP port to listen on (0 picks a free one, printed at start)")
    stop_timeout_s: float = doc(10.0, "on SIGTERM: how long in-flight requests may finish")
    debug_endpoints: bool = doc(
        False, "expose GET /debug/* (the server's integrity, a fleet router's index)", debug=True
    )
    log_level: str = doc("warning", "uvicorn log level")
    parent_pid: int = doc(
        0,
        "stop (as on SIGTERM) once the process with this pid, our parent, is gone: set by "
        "launchers (`kvstrata run`, benchmarks) so a kill -9 of them leaves no server; 0 = never",
        debug=True,
    )
    api_key: str = doc(
        "",
        "clients must send 'Authorization: Bearer KEY' on every path but /health and /metrics "
        "(as vLLM's --api-key); empty = --api-key-file, else $KVSTRATA_API_KEY read at start, "
        "else no key. On a shared host prefer the file: a command line is visible to every user",
    )
    api_key_file: str = doc("", "a file holding the API key (one line), instead of --api-key")
    max_request_bytes: int = doc(
        16 << 20,
        "largest request body accepted; beyond: 413 before the rest is read. 16 MiB holds a "
        "1M-token prompt as a JSON token-id list (~7 bytes a token) with room to spare",
    )
    client_timeout_s: float = doc(
        60.0,
        "a client gets this long to send a request's headers (from connecting, or from its "
        "last answer) and as long again for its body; beyond: 408 and the connection is "
        "closed, so slow clients (slowloris) cannot hold connections",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.parent_pid < 0:
            raise ValueError(f"parent_pid must be >= 0, got {self.parent_pid}")
        require_positive(self, "stop_timeout_s", "client_timeout_s")

"""Configuration of the HTTP server (the engine, cache and storage keep their own configs)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.configtools import doc

ROLES = ("single", "prefill", "decode", "router")


@dataclass(frozen=True)
class ServeConfig:
    """HTTP server: address, model name, queue bound, timeouts, KV events."""

    host: str = doc("127.0.0.1", "address to listen on")
    port: int = doc(8000, "TCP port to listen on (0 picks a free one, printed at start)")
    served_model_name: str = doc("", "model name clients send; empty = the checkpoint dir name")
    max_pending: int = doc(256, "requests accepted and not finished at most; beyond: 503")
    default_max_tokens: int = doc(256, "max_tokens when a chat request sets none (capped)")
    request_timeout_s: float = doc(600.0, "longest a request may wait for its next token")
    stop_timeout_s: float = doc(10.0, "on SIGTERM: how long in-flight requests may finish")
    kv_events_endpoint: str = doc("", "ZMQ PUB endpoint for KV cache events, e.g. tcp://*:5557")
    kv_events_replay_endpoint: str = doc("", "ZMQ ROUTER endpoint that replays events from a seq")
    kv_events_topic: str = doc("", "topic frame of every KV event message")
    kv_events_buffer: int = doc(10000, "event batches kept for replay")
    kv_events_replay_rate: float = doc(
        10.0,
        "replay requests a subscriber may make per second (a burst of as many); more are "
        "dropped unanswered",
    )
    kv_events_replay_budget: float = doc(
        5000.0,
        "messages per second the replay thread handles, all subscribers together (a request "
        "read: one; each batch of its answer: one more); beyond it requests wait unread in "
        "ZMQ's small queue and then in TCP, so a flooder's sends block",
    )
    kv_events_format: str = doc(
        "vllm",
        "KV events' schema: vllm (vLLM 0.32's tagged maps, cache_salt in extra_keys) | array "
        "(the older tagged arrays, no salt)",
    )
    kv_events_curve_secret_file: str = doc(
        "",
        "KV events: the server's CURVE secret key file (`kvstrata keys curve DIR NAME`: "
        "DIR/NAME.key_secret); with it both event sockets authenticate and encrypt every "
        "subscriber (ZMQ CURVE). Needs kv_events_curve_clients_dir",
    )
    kv_events_curve_clients_dir: str = doc(
        "", "KV events: directory of the public keys (*.key) of the subscribers allowed in"
    )
    debug_endpoints: bool = doc(False, "expose GET /debug/integrity (tests, operators)", debug=True)
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
    role: str = doc(
        "single",
        "single (one server does it all) | prefill | decode (P/D workers) | router (front of P/D)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        for name in ("max_pending", "default_max_tokens", "kv_events_buffer", "max_request_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("kv_events_replay_rate", "kv_events_replay_budget"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.parent_pid < 0:
            raise ValueError(f"parent_pid must be >= 0, got {self.parent_pid}")
        for name in ("request_timeout_s", "stop_timeout_s", "client_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if bool(self.kv_events_curve_secret_file) != bool(self.kv_events_curve_clients_dir):
            raise ValueError(
                "kv_events_curve_secret_file and kv_events_curve_clients_dir go together"
            )
        if self.kv_events_format not in ("vllm", "array"):
            raise ValueError(
                f"kv_events_format must be vllm or array, got {self.kv_events_format!r}"
            )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")

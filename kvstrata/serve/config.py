"""Configuration of the model server's HTTP side (the engine, cache and storage keep their own
configs; the listener's fields are kvstrata.http.config.HttpConfig's, shared with the router)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.configtools import doc
from kvstrata.http.config import HttpConfig

ROLES = ("single", "prefill", "decode", "router")


@dataclass(frozen=True)
class ServeConfig:
    """HTTP server: model name, queue bound, timeouts, KV events (its listener: HttpConfig)."""

    http: HttpConfig = doc(
        HttpConfig(), "address, API key, request limits, graceful stop", cli=False
    )  # the command line reads HttpConfig's options beside this config's
    served_model_name: str = doc("", "model name clients send; empty = the checkpoint dir name")
    max_pending: int = doc(256, "requests accepted and not finished at most; beyond: 503")
    default_max_tokens: int = doc(256, "max_tokens when a chat request sets none (capped)")
    request_timeout_s: float = doc(600.0, "longest a request may wait for its next token")
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
    role: str = doc(
        "single",
        "single (one server does it all) | prefill | decode (P/D workers) | router (front of P/D)",
    )

    def __post_init__(self) -> None:
        for name in ("max_pending", "default_max_tokens", "kv_events_buffer"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("kv_events_replay_rate", "kv_events_replay_budget"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
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

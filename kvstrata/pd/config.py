"""Configuration of a P/D worker's side of the hand-off (`kvstrata serve --role prefill|decode`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.configtools import doc, require_positive

ON_FAILURE = ("error", "local")


@dataclass(frozen=True)
class PDConfig:
    """Prefill/decode hand-off: where prefill listens, which prefill decode asks, time bounds."""

    pd_transfer_endpoint: str = doc(
        "tcp://127.0.0.1:0", "prefill: where the transport listens (port 0 = a free port)"
    )
    pd_transport: str = doc("zmq", "transport of the hand-off (registry name)")
    pd_prefill: str = doc(
        "",
        "decode: prefill workers, comma-separated HTTP base URLs or tcp:// endpoints: the only "
        "ones it hands off to (a request's pd_prefill must name one of them)",
    )
    pd_trust_request_prefill: bool = doc(
        False,
        "decode: take a request's pd_prefill as it is, even outside --pd-prefill (tests that add "
        "prefill workers or relays at run time). Unsafe: any client then picks decode's peer",
        debug=True,
    )
    pd_prefill_api_key_file: str = doc(
        "",
        "decode: a file holding the API key of its prefill workers (started with --api-key), "
        "sent as 'Authorization: Bearer KEY' when it reads their /v1/pd/info",
    )
    pd_curve_secret_file: str = doc(
        "",
        "this worker's CURVE key pair (`kvstrata keys curve DIR NAME`: DIR/NAME.key_secret): "
        "the transfer sockets authenticate and encrypt every peer with it (ZMQ CURVE). Needs "
        "pd_curve_peers_dir. Not given: the pair in pd_keys_dir",
    )
    pd_curve_peers_dir: str = doc(
        "",
        "directory of the public keys (*.key) of the peers allowed: on prefill the decode "
        "workers it serves, on decode the prefill workers it hands off to",
    )
    pd_keys_dir: str = doc(
        "",
        "without pd_curve_secret_file: the owner-only directory of this user's P/D key pair "
        "(made on first start) and of the peers' public keys (*.key); every worker one user "
        "starts on one machine shares it (default ~/.cache/kvstrata/pd-curve)",
    )
    pd_insecure: bool = doc(
        False,
        "transfer sockets without CURVE: any process that reaches them may hand off or answer "
        "pulls (a warning at start). Default: authenticated (pd_curve_* or pd_keys_dir)",
    )
    pd_trust_pulled: bool = doc(
        False,
        "prefill: held pages pulled from a decode worker (and what is computed over them) join "
        "prefill's cache and the shared store (off: they serve that request only; a decode "
        "worker may read this cache, not write it)",
    )
    pd_timeout_s: float = doc(
        10.0, "longest silence (no page, no heartbeat) on a live link before a hand-off fails"
    )
    pd_heartbeat_s: float = doc(
        0.5,
        "prefill: heartbeat interval while a hand-off computes; decode: a link to prefill "
        "down this long (connection refused or lost: a dead worker) fails the hand-off",
    )
    pd_layerwise: bool = doc(
        True, "prefill: send each layer's pages as soon as it is computed (off: all at the end)"
    )
    pd_on_failure: str = doc(
        "error", "decode, failed hand-off: error (502/504) | local (prefill here)"
    )

    def __post_init__(self) -> None:
        require_positive(self, "pd_timeout_s", "pd_heartbeat_s")
        if self.pd_heartbeat_s >= self.pd_timeout_s:
            raise ValueError(
                f"pd_heartbeat_s ({self.pd_heartbeat_s}) must be below pd_timeout_s "
                f"({self.pd_timeout_s}): a live prefill would time out"
            )
        if bool(self.pd_curve_secret_file) != bool(self.pd_curve_peers_dir):
            raise ValueError("pd_curve_secret_file and pd_curve_peers_dir go together")
        if self.pd_insecure and (self.pd_curve_secret_file or self.pd_keys_dir):
            raise ValueError("pd_insecure turns CURVE off: give it no pd_curve_* or pd_keys_dir")
        if self.pd_on_failure not in ON_FAILURE:
            raise ValueError(
                f"pd_on_failure must be one of {ON_FAILURE}, got {self.pd_on_failure!r}"
            )
        for url in self.prefill_urls:
            if not url.startswith(("http://", "https://", "tcp://")):
                raise ValueError(f"pd_prefill entry {url!r} is not an http(s):// or tcp:// address")

    @property
    def prefill_urls(self) -> list[str]:
        return [u.strip() for u in self.pd_prefill.split(",") if u.strip()]

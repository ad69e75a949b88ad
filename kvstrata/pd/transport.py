"""Transports of the hand-off, chosen by name (`--pd-transport`; zmq is the one built in).

A transport gives prefill a `Listener` (many decode peers, each message tagged by its peer) and
decode a `Channel` per hand-off (one peer: the prefill worker). Both are used by one thread
only. Every receive has a bound. Room here for NIXL or Mooncake's transfer engine: they would
register under their own name with the same two classes.

CURVE is on unless --pd-insecure: keys from `--pd-curve-secret-file` / `--pd-curve-peers-dir`,
else this user's own pair (kvstrata/pd/local_keys.py; kvstrata/zmq_curve.py). The
listener is a CURVE server that admits only the decode workers whose public keys it holds, and
each channel a CURVE client that talks only to the prefill key it was given (its /v1/pd/info's
`curve_public_key`, which must be one of decode's peers): a peer without an allowed key gets no
message through either way, and every frame is encrypted.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstrata.pd.config import PDConfig
from kvstrata.pd.local_keys import local_keys
from kvstrata.pd.wire import Frames
from kvstrata.registry import Registry
from kvstrata.zmq_curve import CurveKeys, authenticator


class Listener(Protocol):
    endpoint: str  # the bound address (a free port filled in)

    def recv(self, timeout_s: float) -> tuple[bytes, Frames] | None: ...

    def send(self, peer: bytes, frames: Frames) -> None: ...

    def close(self) -> None: ...


class Channel(Protocol):
    def send(self, frames: Frames) -> None: ...

    def recv(self, timeout_s: float) -> Frames | None: ...

    def unreachable(self, grace_s: float) -> str | None:
        """Why the peer cannot be reached, once the link to it has been down (never up, or
        lost) longer than grace_s; None while it is up or may still come back. A dead or
        refusing peer is known this way within grace_s, not after a silence timeout."""
        ...

    def close(self) -> None: ...


class Transport(Protocol):
    def listen(self, endpoint: str) -> Listener: ...

    def connect(self, endpoint: str, name: str = "", server_key: bytes = b"") -> Channel:
        """A channel to `endpoint`; `name` (the hand-off id) names this end to the listener,
        so a channel that reconnects after a dropped link is the same peer again; server_key:
        the listener's CURVE public key (under CURVE)."""
        ...


TRANSPORTS: Registry[Transport] = Registry("pd transport")


def _bindable(endpoint: str) -> str:
    """zmq spells "any free port" as `*`; our configs say port 0."""
    return endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint


class ZmqListener:
    """A ROUTER socket: frames arrive as [peer identity, *message]."""

    def __init__(self, ctx: zmq.Context, endpoint: str, curve: CurveKeys | None = None) -> None:
        self.auth = authenticator(ctx, curve) if curve is not None else None
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting peer takes its id back
        if curve is not None:
            curve.server(self.sock)
        self.sock.bind(_bindable(endpoint))
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_s: float) -> tuple[bytes, Frames] | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        peer, *frames = self.sock.recv_multipart(copy=False)
        return peer.bytes, [f.buffer for f in frames]

    def send(self, peer: bytes, frames: Frames) -> None:
        # ROUTER drops messages to a peer that went away (decode killed): never blocks on it
        self.sock.send_multipart([peer, *frames], copy=False)

    def close(self) -> None:
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()


LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class LinkWatch:
    """Whether a socket's TCP link to its one peer is up, from the socket's monitor events:
    CONNECTED brings it up; DISCONNECTED (the peer closed or died) or CONNECT_RETRIED (refused:
    nothing listens) starts a down period. zmq keeps reconnecting by itself meanwhile."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.mon = sock.get_monitor_socket(LINK_EVENTS)  # before connect: no event missed
        self.down_since: float | None = time.monotonic()  # not connected yet
        self.was_up = False

    def down_s(self) -> float:
        """How long the link has been down (0.0 while up)."""
        while self.mon.poll(0):
            event = recv_monitor_message(self.mon)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.down_since, self.was_up = None, True
            elif self.down_since is None:
                self.down_since = time.monotonic()
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def close(self) -> None:
        self.sock.disable_monitor()
        self.mon.close(0)


class ZmqChannel:
    """A fresh DEALER per hand-off: nothing of an earlier (failed) hand-off can arrive on it."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        name: str = "",
        curve: CurveKeys | None = None,
        key: bytes = b"",
    ) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            try:
                curve.client(self.sock, key)
            except ValueError:
                self.sock.close(0)
                raise
        if name:  # zmq reconnects by itself; with a fixed id the replies find the new link
            self.sock.setsockopt(zmq.ROUTING_ID, name.encode()[:255])
        self.link = LinkWatch(self.sock)
        self.sock.connect(endpoint)

    def unreachable(self, grace_s: float) -> str | None:
        down = self.link.down_s()
        if down <= grace_s:
            return None
        what = "connection lost" if self.link.was_up else "connection refused"
        return f"unreachable: {what} for {down:.1f} s (the worker is dead or not listening)"

    def send(self, frames: Frames) -> None:
        self.sock.send_multipart(frames, copy=False)

    def recv(self, timeout_s: float) -> Frames | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return [f.buffer for f in self.sock.recv_multipart(copy=False)]

    def close(self) -> None:
        self.link.close()
        self.sock.close(0)


@TRANSPORTS.register("zmq")
class ZmqTransport:
    def __init__(self, curve: CurveKeys | None = None) -> None:
        # under CURVE a context of its own: its ZAP handler answers for this transport only
        self.ctx: Any = zmq.Context() if curve is not None else zmq.Context.instance()
        self.curve = curve

    def listen(self, endpoint: str) -> Listener:
        return ZmqListener(self.ctx, endpoint, self.curve)

    def connect(self, endpoint: str, name: str = "", server_key: bytes = b"") -> Channel:
        curve = self.curve
        if curve is None and server_key:  # else the handshake fails silently: a bare timeout
            raise ValueError(
                f"{endpoint} speaks CURVE only and this worker runs --pd-insecure: drop it (or "
                "give --pd-curve-secret-file and --pd-curve-peers-dir)"
            )
        if curve is not None and not server_key:
            if len(curve.peers) != 1:  # a tcp:// entry: no /v1/pd/info named the key
                raise ValueError(
                    f"{endpoint}: which CURVE key? list the prefill worker by its HTTP URL "
                    f"(its /v1/pd/info names its key) or keep one key in {curve.peers_dir}"
                )
            server_key = next(iter(curve.peers))
        return ZmqChannel(self.ctx, endpoint, name, curve, server_key)


def curve_keys(cfg: PDConfig) -> CurveKeys | None:
    """The transfer sockets' CURVE keys: the given ones, else this user's own pair (made on
    first use); None only under pd_insecure."""
    if cfg.pd_insecure:
        return None
    if cfg.pd_curve_secret_file:
        return CurveKeys.load(cfg.pd_curve_secret_file, cfg.pd_curve_peers_dir, "--pd-curve-*")
    return CurveKeys.load(*local_keys(cfg.pd_keys_dir), "--pd-keys-dir")


def transport_of(cfg: PDConfig, curve: CurveKeys | None = None) -> Transport:
    """The configured transport, with the configured CURVE keys (`curve`: already loaded)."""
    curve = curve or curve_keys(cfg)
    return TRANSPORTS.create(cfg.pd_transport, **({"curve": curve} if curve else {}))

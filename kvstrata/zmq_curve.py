"""ZMQ CURVE for every socket a peer can act on (KV events, P/D transfer): one place that loads
key files made by `kvstrata keys curve DIR NAME` and turns sockets into CURVE servers or clients.

A CURVE server admits only clients whose public key is in its peers directory (pyzmq's
ThreadAuthenticator answers the context's ZAP requests); a client must know the server's public
key, so it cannot be talked to by a peer without the matching secret. Everything after the
handshake is encrypted. A peer that fails the handshake is dropped by ZMQ before any message of
it reaches the socket's owner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class CurveKeys:
    """This end's key pair and the public keys (z85) of the peers it lets in or talks to."""

    public: bytes
    secret: bytes
    peers: frozenset[bytes]
    peers_dir: str  # where `peers` came from (the authenticator reads it again)

    @classmethod
    def load(cls, secret_file: str, peers_dir: str, what: str) -> CurveKeys:
        """`what` names the options in errors (e.g. "--pd-curve-*")."""
        if not Path(secret_file).is_file():
            raise ValueError(f"CURVE secret key file {secret_file} ({what}): no such file")
        public, secret = zmq.auth.load_certificate(secret_file)
        if secret is None:
            raise ValueError(f"CURVE secret key file {secret_file} ({what}): holds no secret key")
        return cls(public, secret, peer_keys(peers_dir, what), peers_dir)

    def server(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (before it binds)."""
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = (
            self.secret,
            self.public,
            True,
        )

    def client(self, sock: zmq.Socket, server_public: bytes) -> None:
        """Make `sock` a CURVE client of the server whose public key is `server_public` (one of
        `peers`, else ValueError: a key this end was not told to trust)."""
        if server_public not in self.peers:
            raise ValueError(
                f"the peer's CURVE public key {server_public.decode(errors='replace')} is not "
                f"in {self.peers_dir}"
            )
        sock.curve_secretkey, sock.curve_publickey = self.secret, self.public
        sock.curve_serverkey = server_public


def peer_keys(peers_dir: str, what: str) -> frozenset[bytes]:
    """The public keys of the *.key files in `peers_dir` (read once: a new peer needs a restart)."""
    path = Path(peers_dir)
    if not path.is_dir():
        raise ValueError(f"CURVE public keys directory {peers_dir} ({what}): not a directory")
    return frozenset(zmq.auth.load_certificate(str(p))[0] for p in sorted(path.glob("*.key")))


def authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """The ZAP handler of `ctx` admitting only clients whose public key is in keys.peers_dir.
    One per context; stop() it when the context's sockets close."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=keys.peers_dir)
    return auth


def write_curve_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """(public file, secret file) of a fresh CURVE key pair (ValueError if either exists)."""
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for p in (public, secret):
        if p.exists():
            raise ValueError(f"{p} exists; remove it first to make a new key pair")
    directory.mkdir(mode=0o700, parents=False, exist_ok=True)
    old = os.umask(0o077)  # the secret file is owner-only from its first byte
    try:
        made = zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(old)
    os.chmod(made[0], 0o644)  # the public half is meant to be handed out
    return Path(made[0]), Path(made[1])

"""`kvstrata keys`: generate key files, owner-only (0600).

    kvstrata keys cluster PATH      the cluster key of shared storage (--storage-key-file): 32
                                    random bytes in hex; every worker of the store reads it
    kvstrata keys curve DIR NAME    a ZMQ CURVE key pair in pyzmq's certificate format:
                                    DIR/NAME.key (public, give it to peers) and
                                    DIR/NAME.key_secret (secret, keep it); KV events servers
                                    (--kv-events-curve-*) and P/D transfer sockets
                                    (--pd-curve-*) use them
An existing file is never overwritten (a key rotation is a deliberate `rm` first).
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from kvstrata.zmq_curve import write_curve_pair

__all__ = ["register", "run", "write_cluster_key", "write_curve_pair"]

CLUSTER_KEY_BYTES = 32


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="generate a cluster storage key or a ZMQ CURVE key pair")
    kinds = p.add_subparsers(dest="kind", required=True)
    c = kinds.add_parser("cluster", help="cluster key for --storage-key-file (hex, 0600)")
    c.add_argument("path", type=Path, help="file to create")
    z = kinds.add_parser("curve", help="ZMQ CURVE key pair: DIR/NAME.key and DIR/NAME.key_secret")
    z.add_argument("dir", type=Path, help="directory to write into (created 0700 if missing)")
    z.add_argument("name", help="base name of the two files")
    p.set_defaults(func=run)


def write_cluster_key(path: Path) -> None:
    """A fresh key in a new owner-only file (FileExistsError if `path` exists: a race)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(CLUSTER_KEY_BYTES) + "\n")


def run(args: argparse.Namespace) -> int:
    if args.kind == "cluster":
        if args.path.exists():
            raise ValueError(f"{args.path} exists; remove it first to make a new key")
        write_cluster_key(args.path)
        print(f"cluster key: {args.path} (0600); pass it as --storage-key-file on every worker")
        return 0
    public, secret = write_curve_pair(args.dir, args.name)
    print(f"CURVE public key: {public}\nCURVE secret key: {secret} (0600)")
    return 0

"""The P/D transfer sockets' CURVE keys when none are given: one key pair per user and machine.

P/D transfer is authenticated by default. A worker started without --pd-curve-secret-file (and
without --pd-insecure) uses the key pair `local` in its keys directory (--pd-keys-dir, default
~/.cache/kvstrata/pd-curve), made on the first start there: the directory is created 0700 and
must stay owned by this user and closed to everyone else (else the worker refuses to start,
naming it). The same directory is the peers directory: every *.key in it is a peer allowed in.
So every worker a user starts on one machine (`kvstrata run`, LocalPD, tests) shares one
identity and admits the others with no step of the user's, while another local user's process,
which cannot read the directory, is refused at the handshake. Workers on other machines: copy
the directory (or give each worker --pd-curve-* keys from `kvstrata keys curve`).
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from kvstrata.zmq_curve import write_curve_pair

NAME = "local"  # the shared key pair: NAME.key (public), NAME.key_secret


def default_keys_dir() -> Path:
    return Path.home() / ".cache" / "kvstrata" / "pd-curve"


def local_keys(keys_dir: str = "") -> tuple[str, str]:
    """(secret key file, peers directory) of this user's P/D key pair in `keys_dir` ("": the
    default), made on first use. ValueError when the directory or the secret file is open to
    other users, or owned by another."""
    path = Path(keys_dir) if keys_dir else default_keys_dir()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    owner_only(path, "--pd-keys-dir")
    lock = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:  # two workers starting at once: one makes the pair, the other then reads it
        fcntl.flock(lock, fcntl.LOCK_EX)
        secret = path / f"{NAME}.key_secret"
        if not secret.exists():
            write_curve_pair(path, NAME)
    finally:
        os.close(lock)
    owner_only(secret, "--pd-keys-dir")
    return str(secret), str(path)


def owner_only(path: Path, option: str) -> None:
    """ValueError naming `option` unless `path` is this user's and closed to group and others."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"{option}: {path} is mode {stat.filemode(st.st_mode)} owned by uid {st.st_uid}; "
            f"it must be this user's (uid {os.getuid()}) and closed to others (chmod go-rwx)"
        )

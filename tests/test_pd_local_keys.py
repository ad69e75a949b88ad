"""The P/D key pair a worker uses when no key option is given (kvstrata/pd/local_keys.py): made
once in an owner-only directory, shared by every worker of the user, refused when the directory
or the secret is open to others; and the transport it yields admits exactly that key."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvstrata.pd.config import PDConfig
from kvstrata.pd.local_keys import local_keys
from kvstrata.pd.transport import curve_keys, transport_of
from kvstrata.zmq_curve import write_curve_pair


def test_made_once_owner_only_and_shared(tmp_path: Path) -> None:
    where = tmp_path / "keys"
    got: list[tuple[str, str]] = []
    threads = [
        threading.Thread(target=lambda: got.append(local_keys(str(where)))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1  # four workers starting at once: one pair
    secret, peers = got[0]
    assert (Path(secret), Path(peers)) == (where / "local.key_secret", where)
    assert os.stat(where).st_mode & 0o777 == 0o700 and os.stat(secret).st_mode & 0o777 == 0o600
    first = Path(secret).read_bytes()
    assert local_keys(str(where)) == got[0] and Path(secret).read_bytes() == first  # kept
    keys = curve_keys(PDConfig(pd_keys_dir=str(where)))
    assert keys is not None and keys.peers == frozenset({keys.public})  # it admits itself


def test_a_key_dir_open_to_others_is_refused_by_name(tmp_path: Path) -> None:
    where = tmp_path / "open"
    local_keys(str(where))
    where.chmod(0o755)
    with pytest.raises(ValueError, match=r"--pd-keys-dir: .*open.* mode drwxr-xr-x"):
        local_keys(str(where))
    where.chmod(0o700)
    (where / "local.key_secret").chmod(0o644)
    with pytest.raises(ValueError, match=r"local.key_secret is mode -rw-r--r--"):
        local_keys(str(where))


def test_insecure_is_explicit_and_alone(tmp_path: Path) -> None:
    assert curve_keys(PDConfig(pd_insecure=True)) is None
    assert getattr(transport_of(PDConfig(pd_insecure=True)), "curve", None) is None
    with pytest.raises(ValueError, match="pd_insecure turns CURVE off"):
        PDConfig(pd_insecure=True, pd_keys_dir=str(tmp_path))
    public, secret = write_curve_pair(tmp_path / "mine", "w")
    (tmp_path / "peers").mkdir()
    given = curve_keys(
        PDConfig(pd_curve_secret_file=str(secret), pd_curve_peers_dir=str(tmp_path / "peers"))
    )
    assert given is not None and given.peers == frozenset()  # the given keys, not the local pair

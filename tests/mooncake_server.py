"""A real mooncake_master for tests: 127.0.0.1, free ports, its HTTP metadata server on.

`master()` starts one; `held_store()` is a master plus a standalone mooncake_client holding a
segment, yielding the URL for clients that contribute none (what they write outlives them); (a missing binary fails the test with a clear message, never a skip:
scripts/setup_env.sh installs the mooncake extra); `FAST` bounds every client call tightly so
fault tests stay short. The process helper itself lives in kvstrata.bench.local_mooncake
(the storage bench starts masters too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvstrata.bench.local_mooncake import MooncakeHolder, MooncakeMaster
from kvstrata.storage.base import StorageConfig
from kvstrata.storage.config import storage_config

FAST = storage_config(
    mooncake_timeout_s=1.0,
    mooncake_setup_timeout_s=10.0,
    reconnect_backoff_s=0.05,
    reconnect_backoff_max_s=0.2,
)


def fast(**changes: object) -> StorageConfig:
    """FAST with mooncake options `changes`."""
    return StorageConfig(mooncake=dataclasses.replace(FAST.mooncake, **changes))  # type: ignore[arg-type]


def master(client_ttl_s: int = 10) -> MooncakeMaster:
    try:
        return MooncakeMaster(client_ttl_s=client_ttl_s).start()
    except RuntimeError as e:
        pytest.fail(str(e))


@contextmanager
def held_store(segment: str = "64MB") -> Iterator[tuple[MooncakeMaster, str]]:
    """A master and a segment holder process; yields (master, URL of segment-less clients)."""
    m = master()
    try:
        holder = MooncakeHolder(m, segment).start()
    except RuntimeError as e:
        m.stop()
        pytest.fail(str(e))
    try:
        yield m, m.url(segment="0")
    finally:
        holder.stop()
        m.stop()

"""A real mooncake_master for tests: 127.0.0.1, free ports, its HTTP metadata server on.

`master()` starts one (a missing binary fails the test with a clear message, never a skip:
scripts/setup_env.sh installs the mooncake extra); `FAST` bounds every client call tightly so
fault tests stay short. The process helper itself lives in kvstrata.storage.mooncake_master
(the storage bench starts masters too).
"""

from __future__ import annotations

import pytest

from kvstrata.storage.base import StorageConfig
from kvstrata.storage.mooncake_master import MooncakeMaster

FAST = StorageConfig(
    mooncake_timeout_s=1.0,
    mooncake_setup_timeout_s=10.0,
    reconnect_backoff_s=0.05,
    reconnect_backoff_max_s=0.2,
)


def master(client_ttl_s: int = 10) -> MooncakeMaster:
    try:
        return MooncakeMaster(client_ttl_s=client_ttl_s).start()
    except RuntimeError as e:
        pytest.fail(str(e))

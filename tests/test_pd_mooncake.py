"""P/D with a real Mooncake Store (one mooncake_master; every worker its own client contributing
a segment) as the shared storage behaves as with redis: a prefix that reached Mooncake through one
decode worker's turn is read from Mooncake by another decode worker that never saw it, so
prefill sends it only the last page; the output equals transformers' greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mooncake_server import master
from tests.test_pd_redis import CKPT, assert_prefix_not_sent, shared_storage_workers

pytestmark = pytest.mark.slow  # a mooncake_master and three worker processes
__all__ = ["CKPT"]  # the redis test's checkpoint (conftest's ckpt builds it)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[dict]:
    m = master()
    try:
        url = m.url(segment="32m", buffer="16m")
        with shared_storage_workers(tmp_path_factory.mktemp("pdm-logs"), ckpt, url) as w:
            yield w
    finally:
        m.stop()


def test_prefix_in_shared_mooncake_is_not_sent(workers: dict, ckpt: Path) -> None:
    assert_prefix_not_sent(workers, ckpt)

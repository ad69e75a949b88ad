"""A Mooncake store outlives its writers: standalone holders contribute the memory and serving
processes none (the default URL). Two `kvstrata run`s in turn through one master: the second, a
fresh process started after the first exited, hits every page the first backed up. With no
holder a put has nowhere to go: a counted skip and one stderr line saying to start one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstrata.bench.local_mooncake import MooncakeHolder, MooncakeMaster
from kvstrata.storage.base import open_storage
from tests.mooncake_server import FAST, held_store, master
from tests.test_run_cmd import PAGE, run_args, tier_hits

pytestmark = pytest.mark.slow  # a mooncake_master, a holder and two `kvstrata run` processes
CKPT = {"seed": 1, "max_position_embeddings": 512}
"""test_run_cmd's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def default_url(m: MooncakeMaster) -> str:
    """The URL a user writes: the master and its metadata server, no `segment` option."""
    return f"mooncake://127.0.0.1:{m.rpc_port}?metadata={m.metadata}"


def run_in_a_process(ckpt: Path, out: Path, url: str) -> dict:
    cmd = [sys.executable, "-m", "kvstrata.cli.main", *run_args(ckpt, out, "--storage-url", url)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no room" not in done.stderr, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_a_store_written_by_one_run_is_read_by_the_next_after_it_exits(
    ckpt: Path, tmp_path: Path
) -> None:
    with held_store() as (m, _):
        first = run_in_a_process(ckpt, tmp_path / "a", default_url(m))
        second = run_in_a_process(ckpt, tmp_path / "b", default_url(m))
    wrote, read = first["configs"]["device_host_storage"], second["configs"]["device_host_storage"]
    assert sum(tier_hits(wrote, "storage")) == 0  # the store started empty
    hittable = [(r["prompt_tokens"] - 1) // PAGE for r in read["requests"]]
    assert tier_hits(read) == hittable  # every page the first run stored comes back
    first_turns = [r["hits"]["storage"] for r in read["requests"] if r["turn"] == 0]
    assert first_turns == [hittable[0], hittable[3]]  # from the store: this process saw none
    stored = wrote["bytes_moved"]["host->storage"]
    assert stored > 0 and read["bytes_moved"]["storage->host"] == stored
    assert [r["output"] for r in read["requests"]] == [r["output"] for r in wrote["requests"]]


def test_a_put_with_no_segment_anywhere_is_a_counted_skip_that_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    m = master()
    try:
        store = open_storage(default_url(m), 4096, FAST)
        pages = [np.full(4096, i, np.uint8) for i in range(3)]
        assert store.put([1, 2, 3], pages) == 0
        assert store.stats()["put_no_space"] == 3 and store.stats()["put_skipped"] == 3
        err = capsys.readouterr().err
        assert "no room" in err and "Start a holder" in err and "mooncake_client" in err
        holder = MooncakeHolder(m, "16MB").start()
        try:
            assert store.put([1, 2, 3], pages) == 3  # the holder's segment takes them
            out = [np.zeros(4096, np.uint8) for _ in range(3)]
            assert store.get([1, 2, 3], out) == 3
            assert all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True))
            assert store.stats()["put_no_space"] == 3
            store.check_integrity()
        finally:
            store.close()
            holder.stop()
    finally:
        m.stop()

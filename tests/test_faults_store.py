"""Fault suite, the file store: orphan temps of dead writers are swept when a store
opens and while it writes, a live writer's temp never; read-only and full stores warn once,
count the failures, leave no temp and keep every stored page intact."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstrata.storage.config import FileStoreConfig, storage_config
from kvstrata.storage.file_store import FileStore
from kvstrata.storage.tmp_files import host_tag

PAGE = 4096


def dead_pid() -> int:
    """A pid that just exited (reaped): not alive on this host."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def tmp_name(host: str, pid: int) -> str:
    return f".{'ab' * 16}.kvp.{host}.{pid}.1.0.tmp"


def temps(root: Path) -> list[Path]:
    return sorted(root.glob("*/.*.tmp"))


def pages(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(n)]


def verify_all(root: Path, expect: dict[int, np.ndarray]) -> None:
    """Every page file verifies (header + checksum) and holds the bytes written."""
    store = FileStore(f"file://{root}", PAGE)
    store.check_integrity()
    for key, page in expect.items():
        out = np.empty(PAGE, np.uint8)
        assert store.get([key], [out]) == 1 and np.array_equal(out, page)
    store.close()


def test_open_sweeps_dead_writers_keeps_live_ones_and_young_foreign(tmp_path: Path) -> None:
    sub = tmp_path / "ab"
    sub.mkdir()
    here = host_tag()
    dead = sub / tmp_name(here, dead_pid())
    live = sub / tmp_name(here, os.getpid())  # this process: alive
    foreign_young = sub / tmp_name("0badc0de" if here != "0badc0de" else "0badc0df", 12345)
    foreign_old = sub / tmp_name("0badc0de" if here != "0badc0de" else "0badc0df", 12346)
    for p in (dead, live, foreign_young, foreign_old):
        p.write_bytes(b"x" * 100)
    old = time.time() - 3600
    os.utime(foreign_old, (old, old))
    store = FileStore(f"file://{tmp_path}", PAGE, FileStoreConfig(stale_tmp_s=600.0))  # size cap 0
    assert sorted(temps(tmp_path)) == sorted([live, foreign_young])
    assert store.stats()["tmp_swept"] == 2
    store.close()


def test_periodic_sweep_while_writing(tmp_path: Path) -> None:
    store = FileStore(f"file://{tmp_path}", PAGE, FileStoreConfig(rescan_interval_s=0.01))
    (tmp_path / "cd").mkdir()
    orphan = tmp_path / "cd" / tmp_name(host_tag(), dead_pid())
    orphan.write_bytes(b"x")
    time.sleep(0.02)
    data = pages(3)
    assert store.put([1, 2, 3], data) == 3
    assert not orphan.exists() and temps(tmp_path) == []
    store.close()
    verify_all(tmp_path, dict(zip([1, 2, 3], data, strict=True)))


def test_writer_killed_mid_write_leaves_an_orphan_the_next_open_sweeps(tmp_path: Path) -> None:
    """A real writer process is SIGKILLed while it writes pages: whatever temp it left is gone
    after the next open; every complete page still verifies."""
    code = (
        "import numpy as np, sys\n"
        "from kvstrata.storage.file_store import FileStore\n"
        f"s = FileStore('file://{tmp_path}', 1 << 20)\n"
        "p = np.zeros(1 << 20, np.uint8)\n"
        "print('ready', flush=True)\n"
        "k = 1\n"
        "while True:\n"
        "    s.put([k], [p]); k += 1\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=os.getcwd())
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 20
    while not temps(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    FileStore(f"file://{tmp_path}", 1 << 20).close()
    assert temps(tmp_path) == []
    FileStore(f"file://{tmp_path}", 1 << 20).check_integrity()


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Path]:
    """tmp_path/{src, ro (read-only bind of src), full (64 KiB tmpfs)}; skipped when not root."""
    if os.geteuid() != 0:
        pytest.skip("mount needs root (read-only bind mount and tmpfs)")
    (tmp_path / "src").mkdir()
    (tmp_path / "ro").mkdir()
    (tmp_path / "full").mkdir()
    bind = ["mount", "--bind", "-o", "ro", str(tmp_path / "src"), str(tmp_path / "ro")]
    r = subprocess.run(bind, capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mount not permitted here: {r.stderr.strip()}")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path / "full")],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        subprocess.run(["umount", str(tmp_path / "ro")])
        pytest.skip(f"tmpfs mount not permitted here: {r.stderr.strip()}")
    yield tmp_path
    subprocess.run(["umount", str(tmp_path / "ro")])
    subprocess.run(["umount", str(tmp_path / "full")])


def test_read_only_store_serves_reads_warns_once(
    mounts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = pages(2)
    w = FileStore(f"file://{mounts / 'src'}", PAGE)
    assert w.put([1, 2], data) == 2
    w.close()
    ro = FileStore(f"file://{mounts / 'ro'}", PAGE)
    assert ro.put([3, 4], pages(2, seed=1)) == 0 and ro.put([5], pages(1, seed=2)) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning: storage write" in err[0] and "Read-only" in err[0]
    assert ro.stats()["put_errors"] == 3
    out = np.empty(PAGE, np.uint8)
    assert ro.get([1], [out]) == 1 and np.array_equal(out, data[0])
    ro.close()
    verify_all(mounts / "src", {1: data[0], 2: data[1]})
    assert temps(mounts / "src") == []


def test_full_store_counts_failures_and_leaves_no_temp(
    mounts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileStore(f"file://{mounts / 'full'}", PAGE)
    data = pages(40)  # 40 x 4 KiB > 64 KiB
    stored = store.put(list(range(1, 41)), data)
    assert 0 < stored < 40 and store.stats()["put_errors"] == 40 - stored
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left" in err[0]
    store.close()
    assert temps(mounts / "full") == []
    kept = dict(zip(range(1, 41), data, strict=True))
    s = FileStore(f"file://{mounts / 'full'}", PAGE)
    hits = {}
    for k in kept:
        out = np.empty(PAGE, np.uint8)
        if s.get([k], [out]):
            hits[k] = out
            assert np.array_equal(out, kept[k])
    assert len(hits) == stored  # every stored page verifies, no partial page is visible
    s.check_integrity()


def test_redis_down_warns_once_then_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """A real redis-server killed under a store: the first failed write is one warning line,
    later ones are counted (put_skipped)."""
    from kvstrata.storage.base import open_storage
    from tests.redis_server import RedisServer

    fast = storage_config(socket_timeout_s=0.5, connect_timeout_s=0.2, reconnect_backoff_s=0.05)
    server = RedisServer().start()
    try:
        store = open_storage(server.url, PAGE, fast)
        data = pages(3)
        assert store.put([1], data[:1]) == 1
        server.kill()
        assert store.put([2], data[1:2]) == 0
        time.sleep(0.1)
        assert store.put([3], data[2:]) == 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "warning: storage write to redis://" in err[0], err
        assert store.stats()["put_skipped"] == 2
        store.close()
    finally:
        server.stop()

"""Storage options per backend: `--help` lists each backend's own options under its group, and a
command line giving one with a store of another backend (or with no store) is refused by name,
one line, exit 2, before any model loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstrata.cli import validate
from kvstrata.cli.main import build_parser, main
from kvstrata.cli.run_cmd import STORAGE_PREFIX

GROUPS = {
    "StorageConfig": {"--storage-read-threads", "--storage-key-file", "--storage-encrypt"},
    "StorageConfig: file and mem backends": {"--storage-max-bytes"},
    "StorageConfig: file backend": {
        "--storage-evict-to-fraction", "--storage-rescan-interval-s", "--storage-fsync",
        "--storage-create-dir", "--storage-touch-on-read", "--storage-stale-tmp-s",
        "--storage-group-access", "--storage-seal-check-thread",
    },
    "StorageConfig: file and redis backends": {"--storage-stale-unit-s"},
    "StorageConfig: redis backend": {
        "--storage-redis-key-prefix", "--storage-redis-ttl-s", "--storage-redis-batch-pages",
        "--storage-socket-timeout-s",
    },
    "StorageConfig: mooncake backend": {
        "--storage-mooncake-batch-pages", "--storage-mooncake-timeout-s",
        "--storage-mooncake-setup-timeout-s",
    },
    "StorageConfig: redis and mooncake backends": {
        "--storage-connect-timeout-s", "--storage-reconnect-backoff-s",
        "--storage-reconnect-backoff-max-s", "--storage-require-reachable-at-start",
    },
}  # fmt: skip


def test_help_lists_each_backends_options_in_its_group(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    sections = re.split(r"^(?=\S.*:$)", text, flags=re.M)
    got = {
        s.splitlines()[0][:-1]: set(re.findall(r"^  (--[a-z0-9-]+)", s, re.M))
        for s in sections
        if s.startswith("StorageConfig")
    }
    assert got == GROUPS


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["--storage-url", "redis://127.0.0.1:1", "--storage-fsync"],
         "--storage-fsync is read by the file backend, not by redis (the store redis://127.0.0.1:1)"),
        (["--storage-url", "mem://", "--no-storage-touch-on-read"],
         "--storage-touch-on-read is read by the file backend, not by mem (the store mem://)"),
        (["--storage-url", "STORE", "--storage-redis-ttl-s", "5"],
         "--storage-redis-ttl-s is read by the redis/rediss backend, not by file (the store STORE)"),
        (["--storage-url", "STORE", "--storage-mooncake-timeout-s", "1"],
         "--storage-mooncake-timeout-s is read by the mooncake backend, not by file"),
        (["--storage-key-file", "k"],
         "--storage-key-file needs --storage-url (without a store nothing reads it)"),
    ],
)  # fmt: skip
def test_an_option_the_store_does_not_read_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], refusal: str
) -> None:
    argv = [a.replace("STORE", f"file://{tmp_path}") for a in argv]
    refusal = refusal.replace("STORE", f"file://{tmp_path}")
    assert main(["serve", "--model", str(tmp_path / "none"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstrata serve: error: ") and err.count("\n") == 1
    assert refusal in err


def test_a_run_without_storage_url_stores_in_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["run", "--out", str(out), "--storage-redis-batch-pages", "4"]) == 2
    err = capsys.readouterr().err
    assert f"not by file (the store file://{(out / 'store').resolve()})" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("url", "given"),
    [
        ("redis://127.0.0.1:1", ["--storage-redis-ttl-s", "5", "--storage-stale-unit-s", "900",
                                 "--storage-connect-timeout-s", "1", "--storage-key-file", "k"]),
        ("rediss://127.0.0.1:1", ["--storage-socket-timeout-s", "2"]),
        ("mooncake://h:1?metadata=http://h:2", ["--storage-mooncake-batch-pages", "4",
                                                 "--no-storage-require-reachable-at-start"]),
        ("file:///x", ["--storage-max-bytes", "10", "--storage-fsync", "--storage-stale-unit-s",
                       "900", "--storage-encrypt", "--storage-key-file", "k"]),
        ("mem://", ["--storage-max-bytes", "10"]),
    ],
)  # fmt: skip
def test_a_backends_own_options_pass_with_its_store(url: str, given: list[str]) -> None:
    args = build_parser().parse_args(["serve", "--storage-url", url, *given])
    validate.check_storage_options(args, STORAGE_PREFIX, url)

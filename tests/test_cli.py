"""The command line: every command's help renders, and the subcommands are all wired."""

from __future__ import annotations

import pytest

from kvstrata.cli.main import build_parser, main

COMMANDS = ("run", "bench", "replay", "simulate", "check-consensus")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_renders(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert command in capsys.readouterr().out


def test_every_command_is_wired() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices)  # type: ignore[union-attr]


def test_bench_list_names_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    listed = set(capsys.readouterr().out.split())
    assert {"radix", "transfer", "storage", "ttft", "consensus"} <= listed


def test_every_registered_storage_scheme_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI validates a storage URL against the storage registry itself (mem:// was refused
    by a list of backend modules of its own)."""
    from kvstrata.cli import validate
    from kvstrata.storage.base import load_backends

    # a URL each backend's own parser takes (mooncake:// needs its master's address)
    urls = {"mooncake": "mooncake://127.0.0.1:50051"}
    for scheme in load_backends().names():
        if scheme != "file":  # file:// checks its directory; covered by the storage tests
            validate.check_storage_url(urls.get(scheme, f"{scheme}://"), "--storage-url")
    argv = ["replay", "gen:multi-turn", "--max-requests", "3", "--storage-url", "mem://"]
    assert main(argv) == 0, capsys.readouterr().err
    with pytest.raises(validate.InputError, match="unknown storage URL scheme 'nope'"):
        validate.check_storage_url("nope://x", "--storage-url")

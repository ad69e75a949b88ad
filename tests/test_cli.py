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

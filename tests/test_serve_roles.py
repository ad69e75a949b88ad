"""`kvstrata serve --role R --help` lists what role R reads; the command line takes every role's."""

from __future__ import annotations

import argparse
import re

import pytest

from kvstrata.cli.main import build_parser
from kvstrata.configtools import DEBUG_GROUP

ROUTER_OPTIONS = {
    "--host", "--port", "--served-model-name", "--stop-timeout-s", "--log-level", "--parent-pid",
    "--role", "--router-info-timeout-s", "--router-start-timeout-s", "--router-connect-timeout-s",
    "--router-read-timeout-s", "--router-down-s", "--router-health-interval-s",
    "--router-require-info", "--prefill", "--decode", "--api-key", "--api-key-file",
    "--router-worker-api-key-file", "--replicas", "--routing", "--kv-indexer-url",
    "--router-load-weight", "--router-kv-events-curve-secret-file",
    "--router-kv-events-curve-peers-dir", "--debug-endpoints",
}  # fmt: skip
DEBUG_OPTIONS = ("--parent-pid", "--debug-endpoints", "--inject-divergence",
                 "--storage-emulate-read-s-per-page")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    return build_parser()


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["serve", *argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def options(text: str) -> set[str]:
    return set(re.findall(r"^  (--[a-z0-9-]+)", text, re.M))


def test_router_help_lists_only_what_the_router_reads(capsys: pytest.CaptureFixture[str]) -> None:
    assert options(help_of(capsys, "--role", "router")) == ROUTER_OPTIONS


def test_each_worker_role_lists_its_own_pd_options(capsys: pytest.CaptureFixture[str]) -> None:
    single = options(help_of(capsys))
    prefill = options(help_of(capsys, "--role", "prefill"))
    decode = options(help_of(capsys, "--role", "decode"))
    assert not any(o.startswith(("--pd-", "--router-")) for o in single)
    assert prefill - single == {
        "--pd-transfer-endpoint", "--pd-transport", "--pd-timeout-s", "--pd-heartbeat-s",
        "--pd-layerwise", "--pd-curve-secret-file", "--pd-curve-peers-dir",
    }  # fmt: skip
    assert decode - single == {
        "--pd-transport",
        "--pd-prefill",
        "--pd-prefill-api-key-file",
        "--pd-trust-request-prefill",
        "--pd-curve-secret-file",
        "--pd-curve-peers-dir",
        "--pd-timeout-s",
        "--pd-on-failure",
    }


def test_hooks_sit_in_the_debug_group(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys)
    lines = text[text.index(DEBUG_GROUP) :].splitlines()[1:]
    end = next((i for i, line in enumerate(lines) if line and not line.startswith(" ")), None)
    assert options("\n".join(lines[:end])) == set(DEBUG_OPTIONS)
    assert not options("\n".join(lines[end:])) & set(DEBUG_OPTIONS)


def test_the_command_line_takes_every_roles_options() -> None:
    args = parser().parse_args(
        ["serve", "--role", "router", "--prefill", "http://a:1", "--router-down-s", "3",
         "--page-size", "4", "--pd-prefill", "http://b:2", "--inject-divergence", "1:0"]
    )  # fmt: skip
    assert (args.role, args.router_prefill, args.router_down_s) == ("router", ["http://a:1"], 3.0)
    assert (args.page_size, args.pd_prefill, args.inject_divergence) == (4, "http://b:2", "1:0")


def test_an_unknown_role_is_refused_at_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["serve", "--role", "nope", "--help"])
    assert exc.value.code == 2 and "--role must be one of" in capsys.readouterr().err

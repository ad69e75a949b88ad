"""`kvstrata serve --role R` takes only the options role R reads (`--help` lists them); any other
is refused by name, one line, exit 2."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from kvstrata.cli.main import build_parser
from kvstrata.configtools import DEBUG_GROUP
from kvstrata.http.config import HttpConfig
from kvstrata.router.config import RouterConfig, router_config_from_args

ROUTER_OPTIONS = {
    "--host", "--port", "--served-model-name", "--stop-timeout-s", "--log-level", "--parent-pid",
    "--role", "--router-info-timeout-s", "--router-start-timeout-s", "--router-connect-timeout-s",
    "--router-read-timeout-s", "--router-down-s", "--router-health-interval-s",
    "--router-require-info", "--prefill", "--decode", "--api-key", "--api-key-file",
    "--router-worker-api-key-file", "--max-request-bytes", "--client-timeout-s",
    "--replicas", "--routing", "--kv-indexer-url",
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
        "--pd-layerwise", "--pd-curve-secret-file", "--pd-curve-peers-dir", "--pd-keys-dir",
        "--pd-insecure", "--pd-trust-pulled",
    }  # fmt: skip
    assert decode - single == {
        "--pd-transport",
        "--pd-prefill",
        "--pd-prefill-api-key-file",
        "--pd-trust-request-prefill",
        "--pd-curve-secret-file",
        "--pd-curve-peers-dir",
        "--pd-keys-dir",
        "--pd-insecure",
        "--pd-timeout-s",
        "--pd-on-failure",
    }


def test_hooks_sit_in_the_debug_group(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys)
    lines = text[text.index(DEBUG_GROUP) :].splitlines()[1:]
    end = next((i for i, line in enumerate(lines) if line and not line.startswith(" ")), None)
    assert options("\n".join(lines[:end])) == set(DEBUG_OPTIONS)
    assert not options("\n".join(lines[end:])) & set(DEBUG_OPTIONS)


def test_a_role_parses_its_own_options() -> None:
    args = parser().parse_args(
        ["serve", "--role", "router", "--prefill", "http://a:1", "--router-down-s", "3",
         "--api-key", "k"]
    )  # fmt: skip
    assert (args.role, args.router_prefill, args.router_down_s) == ("router", ["http://a:1"], 3.0)
    assert args.api_key == "k" and not hasattr(args, "page_size")
    args = parser().parse_args(
        ["serve", "--page-size", "4", "--role=decode", "--pd-prefill", "http://b:2"]
    )
    assert (args.role, args.page_size, args.pd_prefill) == ("decode", 4, "http://b:2")


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["--role", "router", "--device-pages", "8"],
         "--role router does not read --device-pages (read by --role single, prefill, decode)"),
        (["--role", "prefill", "--pd-prefill", "http://b:2"],
         "--role prefill does not read --pd-prefill (read by --role decode)"),
        (["--role", "decode", "--pd-heartbeat-s", "1"],
         "--role decode does not read --pd-heartbeat-s (read by --role prefill)"),
        (["--prefill", "http://a:1"], "--role single does not read --prefill (read by --role router)"),
        (["--role", "single", "--no-pd-layerwise"],
         "--role single does not read --no-pd-layerwise (read by --role prefill)"),
        (["--role", "single", "--decode", "8"],  # not taken for --decode-step-tokens
         "--role single does not read --decode (read by --role router)"),
        (["--role", "router", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    ],
)  # fmt: skip
def test_an_option_the_role_does_not_read_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], argv: list[str], refusal: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["serve", *argv])
    err = capsys.readouterr().err.splitlines()
    role = argv[argv.index("--role") + 1] if "--role" in argv else "single"
    assert exc.value.code == 2 and err[-1] == f"kvstrata serve --role {role}: error: {refusal}"


def test_an_unknown_role_is_refused_at_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["serve", "--role", "nope", "--help"])
    assert exc.value.code == 2 and "--role must be one of" in capsys.readouterr().err


def test_the_router_config_holds_exactly_what_the_router_reads() -> None:
    """The router's one config: its listener (HttpConfig, shared with `serve`) and its own
    fields, parsed from the router's command line; nothing of ServeConfig."""
    assert [f.name for f in dataclasses.fields(HttpConfig)] == [
        "host", "port", "stop_timeout_s", "debug_endpoints", "log_level", "parent_pid",
        "api_key", "api_key_file", "max_request_bytes", "client_timeout_s",
    ]  # fmt: skip
    assert {f.name for f in dataclasses.fields(RouterConfig)} == {
        "http", "served_model_name", "prefill", "decode", "replicas", "routing",
        "kv_indexer_url", "load_weight", "kv_events_curve_secret_file",
        "kv_events_curve_peers_dir", "info_timeout_s", "start_timeout_s", "connect_timeout_s",
        "read_timeout_s", "down_s", "health_interval_s", "worker_api_key_file", "require_info",
    }  # fmt: skip
    args = parser().parse_args(
        ["serve", "--role", "router", "--replicas", "http://a:1", "--port", "0", "--api-key",
         "k", "--served-model-name", "m", "--router-down-s", "3", "--client-timeout-s", "5"]
    )  # fmt: skip
    cfg = router_config_from_args(args)
    assert cfg.http == HttpConfig(port=0, api_key="k", client_timeout_s=5.0)
    assert (cfg.served_model_name, cfg.replicas, cfg.down_s) == ("m", ("http://a:1",), 3.0)
    with pytest.raises(TypeError, match="max_pending"):
        RouterConfig(max_pending=8)  # type: ignore[call-arg]


def test_the_router_imports_nothing_of_serve() -> None:
    """Shared HTTP pieces come from kvstrata.http; the router never reaches into `serve`."""
    router = Path(__file__).parent.parent / "kvstrata" / "router"
    found = []
    for path in sorted(router.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith("kvstrata.serve")]
    assert found == []

"""`kvstrata` command line: one subcommand per module listed in COMMAND_MODULES.

Each command module exposes `register(subparsers) -> None`, adding its parser with
`set_defaults(func=handler)`; a handler takes the parsed args and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES: tuple[str, ...] = (
    "kvstrata.cli.run_cmd",
    "kvstrata.cli.bench_cmd",
    "kvstrata.cli.check_consensus_cmd",
    "kvstrata.cli.replay_cmd",
    "kvstrata.cli.simulate_cmd",
    "kvstrata.cli.serve_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return parser


class UserError(Exception):
    """Bad input from the user: printed as one line on stderr, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError, TypeError) as exc:
        print(f"kvstrata {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`kvstrata` command line: one subcommand per module listed in COMMAND_MODULES.

Each command module exposes `register(subparsers) -> None`, adding its parser with
`set_defaults(func=handler)`; a handler takes the parsed args and returns an exit code.
Bad input (ValueError, FileNotFoundError, UserError) is one line on stderr and exit 2; any other
exception is a bug and keeps its traceback. Ctrl-C and SIGTERM unwind the command (its `finally`
blocks reap child ranks and remove temp files) and end with one line and exit 130 / 143.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

COMMAND_MODULES: tuple[str, ...] = (
    "kvstrata.cli.run_cmd",
    "kvstrata.cli.bench_cmd",
    "kvstrata.cli.check_consensus_cmd",
    "kvstrata.cli.replay_cmd",
    "kvstrata.cli.simulate_cmd",
    "kvstrata.cli.serve_cmd",
    "kvstrata.cli.keys_cmd",
)


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser. One whose options depend on its command line sets the default
    `parse_with(parser, argv, namespace) -> namespace`, which parses argv whole (an option it
    does not take is its error): `kvstrata serve` parses with the parser of the --role given."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parse_with = self.get_default("parse_with")
        if parse_with is None:
            return super().parse_known_args(args, namespace)
        argv = sys.argv[1:] if args is None else list(args)
        defaults, _ = super().parse_known_args([], namespace)  # func, set by the subcommand
        return parse_with(self, argv, defaults), []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return parser


class UserError(Exception):
    """Bad input from the user: printed as one line on stderr, exit code 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so the command unwinds like on Ctrl-C."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = signal.getsignal(signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as exc:
        first = str(exc).strip().splitlines() or [type(exc).__name__]
        print(f"kvstrata {args.command}: error: {first[0]}", file=sys.stderr)
        for line in first[1:]:  # multi-line reports (e.g. every malformed trace line) stay whole
            print(line, file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        how, code = (
            ("terminated (SIGTERM)", 143) if isinstance(exc, Terminated) else ("interrupted", 130)
        )
        print(f"kvstrata {args.command}: {how}; stopped cleanly", file=sys.stderr)
        return code
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())

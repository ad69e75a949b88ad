"""`kvstrata bench NAME [--json PATH] [--quick]`: run one registered benchmark."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstrata.bench.registry import load_benches
from kvstrata.cli import validate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark: prints a table, writes JSON")
    p.add_argument("name", help="benchmark name (see --list)", nargs="?")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--quick", action="store_true", help="a smaller, faster version")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.set_defaults(func=run)


def _table(name: str, report: dict[str, Any]) -> Table:
    table = Table(title=f"kvstrata bench {name}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        if isinstance(value, int | float | str | bool):
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    return table


def run(args: argparse.Namespace) -> int:
    benches = load_benches()
    if args.list or not args.name:
        print("\n".join(benches.names()))
        return 0
    validate.check_name(benches, args.name, "NAME")
    validate.check_out_file(args.json, "--json")
    report = benches.create(args.name, args.quick)
    Console().print(_table(args.name, report))
    if args.json:
        args.json.parent.mkdir(exist_ok=True)  # validated: its own parent exists
        args.json.write_text(json.dumps(report, indent=2))
        print(f"report: {args.json}")
    return 0

"""`kvstrata check-consensus DIR`: compare every rank's decision log; name the first divergence.

Exit codes: 0 all ranks agree, 1 ranks diverged (first step, decision and ranks printed) or a
rank's log ends early (rank stopped),
2 the directory or a log is missing, empty, corrupt, or the logs come from different runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstrata.cli import validate
from kvstrata.ranks.checker import LogError, check_logs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-consensus", help="compare per-rank decision logs (--consensus-log DIR)"
    )
    p.add_argument("dir", type=Path, help="directory holding rank-{r}.jsonl logs")
    p.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    validate.check_out_file(args.json, "--json")
    try:
        result = check_logs(args.dir)
    except LogError as exc:
        print(f"kvstrata check-consensus: error: {exc}", file=sys.stderr)
        return 2
    print(result.text())
    if args.json is not None:
        div = result.divergence
        report = {
            "ok": result.ok,
            "ranks": result.n_ranks,
            "steps": result.n_steps,
            "step": div.step if div else None,
            "diverged_ranks": div.minority if div else [],
            "stopped": {str(r): step for r, step in result.stopped.items()},
            "majority_ranks": div.majority if div else [],
            "decisions": {str(k): v for k, v in div.decisions.items()} if div else {},
        }
        args.json.parent.mkdir(exist_ok=True)  # validated: its own parent exists
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if result.ok else 1

"""Tool-call gaps of agent sessions, drawn from a public trace's inter-turn gaps.

The Mooncake trace (FAST'25; shared/data/mooncake_synthetic_trace.jsonl, see its README) gives
each request's arrival and its prompt's 512-token block ids; requests whose first block is the
same continue one conversation. The gap between two such requests in a row is one inter-turn
gap: the time the client spent between turns (its tool call, for an agent). `kvstrata bench
agent` draws its sessions' think times from these gaps, scaled (the trace's gaps are minutes).
"""

from __future__ import annotations

import random
from pathlib import Path

from kvstrata.workloads.trace import read_mooncake

TRACE_NAME = "mooncake_synthetic_trace.jsonl"


def find_trace(given: str | Path | None = None) -> Path:
    """`given`, or the trace under shared/data next to the repository (or one or two levels up)."""
    if given:
        path = Path(given)
        if not path.is_file():
            raise ValueError(f"--trace: no file at {path}")
        return path
    root = Path(__file__).resolve().parents[2]
    for base in (root, root.parent, root.parent.parent):
        path = base / "shared" / "data" / TRACE_NAME
        if path.is_file():
            return path
    raise ValueError(f"no {TRACE_NAME} under shared/data near {root}: give --trace PATH")


def inter_turn_gaps_s(path: Path) -> list[float]:
    """Every gap (seconds, > 0) between consecutive requests of one conversation, sorted."""
    last: dict[int, float] = {}
    gaps = []
    for req in read_mooncake(path):
        assert req.hash_ids is not None
        first = req.hash_ids[0]
        if first in last and req.arrival_s > last[first]:
            gaps.append(req.arrival_s - last[first])
        last[first] = req.arrival_s
    if not gaps:
        raise ValueError(f"{path}: no conversation with two requests: no inter-turn gap")
    return sorted(gaps)


class GapSampler:
    """Seeded draws of scaled gaps: session s's turn k gets the same gap in every arm."""

    def __init__(self, gaps_s: list[float], scale: float, cap_s: float, seed: int) -> None:
        if scale <= 0 or cap_s <= 0:
            raise ValueError(f"gap scale and cap must be > 0, got {scale} and {cap_s}")
        self.gaps, self.scale, self.cap, self.seed = gaps_s, scale, cap_s, seed

    def gap(self, session: int, turn: int) -> float:
        rng = random.Random(self.seed * 1_000_003 + session * 1009 + turn)
        return min(self.cap, rng.choice(self.gaps) * self.scale)

"""The held-out multi-turn agent trace, as vLLM's custom benchmark dataset (JSONL).

`kvstrata bench serve --vllm-url` replays it through vLLM's own benchmark client (`vllm bench
serve --dataset-name custom --disable-shuffle --skip-chat-template`) against vLLM and against
our server. Coding-agent sessions (kvstrata.agent_text): each turn resends the whole history
plus the agent's call, its tool output and a new question.

Held out: session s draws from Random(HELDOUT_SEED + s), a seed range apart from every session
anything is tuned or trained on: the replayed workload's (kvstrata.workloads.agent, seed *
1_000_003 + s), `bench serve`'s own load (kvstrata.bench.serve_load, seed * 1000 + s) and the
NextN training split (kvstrata.model.nextn_data, 7_000_001 + i).

Rows go turn-major (every session's turn 0, then every session's turn 1, ...). Replayed in file
order at a concurrency below the session count, a session's turn k has ended before its turn
k+1 is sent, and the other sessions' turns in between are what push its prefix out of a KV space
smaller than all the sessions' histories together.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstrata.agent_text import session_messages
from kvstrata.configtools import doc

HELDOUT_SEED = 9_000_001
"""Session s of the trace draws from Random(HELDOUT_SEED + s)."""

Render = Callable[[Sequence[dict[str, str]]], str]
"""A conversation -> the prompt text a completions client sends (the model's chat template)."""


@dataclass(frozen=True)
class TraceSpec:
    """Size of the held-out trace."""

    sessions: int = doc(8, "agent sessions (more than the replay's concurrency)")
    turns: int = doc(10, "turns per session; turn k resends turns 0..k-1 whole")
    first_lines: int = doc(24, "lines of code in a session's first turn (~20 tokens a line)")
    tool_lines: int = doc(5, "lines of tool output each later turn adds")
    output_tokens: int = doc(24, "tokens generated per turn (the replay ignores EOS)")

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "first_lines", "tool_lines", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def trace_rows(spec: TraceSpec, render: Render) -> list[dict[str, str | int]]:
    """The trace's rows in replay order: {"prompt": text, "output_tokens": n}, turn-major."""
    per_session = [
        session_messages(
            random.Random(HELDOUT_SEED + s), spec.first_lines, spec.tool_lines, spec.turns
        )
        for s in range(spec.sessions)
    ]
    return [
        {"prompt": render(per_session[s][k]), "output_tokens": spec.output_tokens}
        for k in range(spec.turns)
        for s in range(spec.sessions)
    ]


def write_trace(path: Path, rows: Sequence[dict[str, str | int]]) -> Path:
    """One JSON object a line, keys sorted (the same rows give the same bytes)."""
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return path

"""The built-in multi-turn coding-agent workload replayed by `kvstrata run`.

Several sessions; in each, turn k's prompt is turn k-1's prompt plus the agent's (fixed) action,
the tool output it got back and a new question, so the history grows and every turn shares a
long prefix with the one before. Text is drawn from a fixed vocabulary of code-like lines with a
seeded RNG (kvstrata.agent_text) and rendered through the model's chat template (plain text turns
for a base checkpoint that has none: Tokenizer.render_chat); the whole workload is a pure function
of (WorkloadSpec, tokenizer). A checkpoint without a tokenizer (the tiny test models) gets token
ids drawn directly from its vocabulary instead, with the same growth pattern.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstrata.agent_text import session_messages
from kvstrata.engine.request import Request

ChatEncoder = Callable[[Sequence[dict[str, str]]], list[int]]


@dataclass(frozen=True)
class WorkloadSpec:
    """Size of the replayed workload (all counts are per session)."""

    sessions: int = 3
    turns: int = 4
    first_lines: int = 60  # lines of code in the first turn's context
    tool_lines: int = 40  # lines of tool output added per turn
    max_new_tokens: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "first_lines", "tool_lines", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _session_messages(spec: WorkloadSpec, rng: random.Random) -> list[list[dict[str, str]]]:
    """Per turn, the whole conversation so far (the history only grows)."""
    return session_messages(rng, spec.first_lines, spec.tool_lines, spec.turns)


def _session_ids(spec: WorkloadSpec, rng: random.Random, vocab_size: int) -> list[list[int]]:
    """Token-id version: ~10 ids per line, ids drawn from the whole vocabulary."""
    low = min(3, vocab_size - 1)  # keep clear of the usual special ids 0..2

    def draw(lines: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(10 * lines)]

    hist = draw(spec.first_lines)
    out = []
    for _ in range(spec.turns):
        hist = hist + draw(spec.tool_lines + 2)
        out.append(list(hist))
    return out


def build_workload(
    spec: WorkloadSpec, vocab_size: int, encode_chat: ChatEncoder | None = None
) -> list[list[list[int]]]:
    """Prompts as [session][turn] -> token ids; deterministic in (spec, tokenizer)."""
    sessions = []
    for s in range(spec.sessions):
        rng = random.Random(spec.seed * 1_000_003 + s)
        if encode_chat is None:
            sessions.append(_session_ids(spec, rng, vocab_size))
        else:
            sessions.append([encode_chat(m) for m in _session_messages(spec, rng)])
    return sessions


class SessionTurns:
    """Feeds a [session][turn] prompt set: every session's first turn at once, then turn k+1 of a
    session as soon as its turn k finished, so sessions interleave in the batch. Request ids are
    `s{session}t{turn}`. `poll(finished)` returns the new requests, or None once all are done."""

    def __init__(self, prompts: Sequence[Sequence[list[int]]], max_new_tokens: int) -> None:
        self.prompts, self.max_new = prompts, max_new_tokens
        self.next_turn = [0] * len(prompts)
        self.pending = 0

    def _make(self, s: int) -> Request:
        k = self.next_turn[s]
        self.next_turn[s] += 1
        self.pending += 1
        return Request(f"s{s}t{k}", list(self.prompts[s][k]), max_new_tokens=self.max_new)

    def poll(self, finished: Sequence[Request]) -> list[Request] | None:
        out = [self._make(s) for s in range(len(self.prompts)) if self.next_turn[s] == 0]
        for req in finished:
            self.pending -= 1
            s = session_of(req.rid)
            if self.next_turn[s] < len(self.prompts[s]):
                out.append(self._make(s))
        if not out and not self.pending:
            return None
        return out


def session_of(rid: str) -> int:
    return int(rid[1:].split("t")[0])


def turn_of(rid: str) -> int:
    return int(rid[1:].split("t")[1])

"""Feeds of engine requests: what a driving loop asks for new work after each step.

A `Workload` is polled with the requests that just finished and answers with new ones (None once
it is exhausted). `drive` is the one loop that feeds an engine from a workload: `kvstrata run`
uses it on one rank, the rank loop on many (with rank 0's workload broadcast to every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request
from kvstrata.engine.step_result import StepResult


class Workload(Protocol):
    """Feeds requests at rank 0: new requests after the ones that just finished; None = done."""

    def poll(self, finished: list[Request]) -> list[Request] | None: ...


def drive(
    engine: Engine, workload: Workload, before_step: Callable[[], None] | None = None
) -> Iterator[StepResult]:
    """Poll, submit, step until the workload is exhausted and the engine idle; yields each
    step's result (the next poll sees the requests it ended)."""
    finished: list[Request] = []
    while True:
        new = workload.poll(finished)
        if new is None and not engine.has_work():
            return
        if before_step is not None:
            before_step()
        for req in new or []:
            engine.submit(req)
        result = engine.step()
        finished = result.ended
        yield result


@dataclass
class StaticWorkload:
    """All requests at the first step."""

    requests: list[Request]
    _sent: bool = False

    def poll(self, finished: list[Request]) -> list[Request] | None:
        if self._sent:
            return None
        self._sent = True
        return list(self.requests)


@dataclass
class MultiTurn:
    """Conversations: turn k+1 = turn k's prompt + its output + the next user chunk."""

    conversations: list[list[list[int]]]  # [conversation][turn] -> new user tokens
    max_new_tokens: int = 4
    keep_logits: bool = False
    _turn: dict[int, int] = field(default_factory=dict)
    _started: bool = False

    def _make(self, c: int, prev: Request | None) -> Request:
        t = self._turn[c] = self._turn.get(c, -1) + 1
        base = prev.tokens + prev.output if prev is not None else []
        return Request(
            f"c{c}t{t}",
            base + self.conversations[c][t],
            self.max_new_tokens,
            keep_logits=self.keep_logits,
        )

    def poll(self, finished: list[Request]) -> list[Request] | None:
        out = [] if self._started else [self._make(c, None) for c in range(len(self.conversations))]
        self._started = True
        for req in finished:
            c = int(req.rid[1 : req.rid.index("t")])
            if self._turn[c] + 1 < len(self.conversations[c]):
                out.append(self._make(c, req))
        if not out and all(
            self._turn.get(c, -1) + 1 >= len(v) for c, v in enumerate(self.conversations)
        ):
            return None
        return out

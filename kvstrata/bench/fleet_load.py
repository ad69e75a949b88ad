"""Agent sessions at a fixed arrival rate (`kvstrata bench fleet`): request i of the turn-major
order (turn 0 of every session, then turn 1, ...) is sent at i / rate seconds, or once its
session's previous turn is answered if that is later (turn k+1 extends turn k's prompt, so it
is only sent after turn k, as an agent would). Each request names its session in the OpenAI
`user` field, the identity a fleet router keeps a session's turns together by.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstrata.bench.pd_load import Prompts, Turn, stream_turn


@dataclass(frozen=True)
class Slot:
    """When one request is due (seconds after the start), and which it is."""

    at_s: float
    session: int
    turn: int


def schedule(prompts: Prompts, rate: float) -> list[Slot]:
    """Every request's slot, turn-major, `rate` requests per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    order = [
        (s, k)
        for k in range(max(len(s) for s in prompts))
        for s in range(len(prompts))
        if k < len(prompts[s])
    ]
    return [Slot(i / rate, s, k) for i, (s, k) in enumerate(order)]


def session_name(s: int) -> str:
    return f"session-{s}"


def drive_at_rate(
    url: str, prompts: Prompts, max_tokens: int, rate: float, timeout_s: float = 600.0
) -> tuple[list[Turn], float]:
    """Every turn through `url` on the schedule; (turns in send order, wall seconds). The first
    error stops the run."""
    slots = schedule(prompts, rate)
    out: list[tuple[float, Turn]] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def session(s: int) -> None:
        for slot in (x for x in slots if x.session == s):
            time.sleep(max(0.0, t0 + slot.at_s - time.perf_counter()))
            sent = time.perf_counter()
            extra = {"user": session_name(s)}
            turn = stream_turn(url, prompts[s][slot.turn], max_tokens, timeout_s, extra)
            turn.session, turn.turn = s, slot.turn
            with lock:
                out.append((sent, turn))

    with ThreadPoolExecutor(len(prompts)) as pool:
        for fut in [pool.submit(session, s) for s in range(len(prompts))]:
            fut.result()
    wall = time.perf_counter() - t0
    return [t for _, t in sorted(out, key=lambda x: x[0])], wall

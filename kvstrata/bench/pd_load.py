"""Token-id agent sessions through an OpenAI-compatible server (a P/D router or one server).

The prompts are kvstrata/workloads/agent.py's [session][turn] token ids: turn k+1 extends turn
k's prompt, so a worker that served turn k holds all of turn k+1's prefix but the new tokens.
Sessions run in parallel (`concurrency` at a time), a session's turns in order; each turn is one
greedy streaming /v1/completions with usage. TTFT: sending to the first chunk with text.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx

Prompts = Sequence[Sequence[list[int]]]  # [session][turn] -> token ids


@dataclass
class Turn:
    """One answered turn: its text, TTFT and the server's usage (with `pd` on P/D)."""

    session: int
    turn: int
    prompt_tokens: int
    text: str = ""
    ttft_s: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def pd(self) -> dict[str, Any]:
        return dict(self.usage.get("pd") or {})


def stream_turn(
    url: str, prompt: list[int], max_tokens: int, timeout_s: float, extra: dict[str, Any]
) -> Turn:
    """One greedy streamed completion; a worker's error (HTTP or an SSE error event) raises."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, **extra,
    }  # fmt: skip
    turn, parts, t0 = Turn(0, 0, len(prompt)), [], time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                raise RuntimeError(f"{url}: {msg['error'].get('message')}")
            for choice in msg.get("choices") or []:
                if choice.get("text") and not parts:
                    turn.ttft_s = time.perf_counter() - t0
                parts.append(choice.get("text") or "")
            if msg.get("usage"):
                turn.usage = msg["usage"]
    if not turn.usage:
        raise RuntimeError(f"{url}: no usage chunk in the stream")
    turn.text = "".join(parts)
    return turn


def drive(
    url: str,
    prompts: Prompts,
    max_tokens: int,
    concurrency: int,
    tick: Callable[[], None] = lambda: None,
    timeout_s: float = 600.0,
    extra: dict[str, Any] | None = None,
) -> list[Turn]:
    """Every turn of every session, sorted by (session, turn); the first error stops the run.
    `extra`: more request fields (e.g. ignore_eos)."""
    out: list[Turn] = []
    lock = threading.Lock()

    def session(s: int) -> None:
        for k, prompt in enumerate(prompts[s]):
            turn = stream_turn(url, prompt, max_tokens, timeout_s, extra or {})
            turn.session, turn.turn = s, k
            with lock:
                out.append(turn)
            tick()

    with ThreadPoolExecutor(max(1, min(concurrency, len(prompts)))) as pool:
        for fut in [pool.submit(session, s) for s in range(len(prompts))]:
            fut.result()
    return sorted(out, key=lambda t: (t.session, t.turn))


def drive_rounds(
    urls: Sequence[str],
    prompts: Prompts,
    max_tokens: int,
    concurrency: int,
    timeout_s: float = 600.0,
) -> list[list[Turn]]:
    """The same turns on several servers, interleaved so machine-load drift hits them alike:
    round k runs turn k of every session on the first server (`concurrency` at a time), then
    on the next, and so on. Per server: its turns sorted by (session, turn)."""
    out: list[list[Turn]] = [[] for _ in urls]
    workers = max(1, min(concurrency, len(prompts)))
    with ThreadPoolExecutor(workers) as pool:
        for k in range(max(len(s) for s in prompts)):
            live = [s for s in range(len(prompts)) if len(prompts[s]) > k]
            for url, turns in zip(urls, out, strict=True):
                futs = {s: pool.submit(stream_turn, url, prompts[s][k], max_tokens, timeout_s, {})
                        for s in live}  # fmt: skip
                for s, fut in futs.items():
                    turn = fut.result()
                    turn.session, turn.turn = s, k
                    turns.append(turn)
    return [sorted(t, key=lambda t: (t.session, t.turn)) for t in out]


def pages(tokens: int, page: int) -> int:
    """KV pages of `tokens` positions, the partial last page included."""
    return -(-tokens // page)


def expected_pages(prompts: Prompts, page: int) -> list[list[int]]:
    """Pages decode must receive per turn when it keeps what it was sent: turn 0 all of them;
    turn k all but the full pages of turn k-1's prompt (the shared prefix decode holds)."""
    out = []
    for sess in prompts:
        held, row = 0, []
        for prompt in sess:
            row.append(pages(len(prompt), page) - held)
            held = len(prompt) // page
        out.append(row)
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-quantile by rank (the same rule as kvstrata/bench/serve_load.py)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else float("nan")

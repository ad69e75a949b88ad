"""The load of `kvstrata bench serve`: multi-turn agent sessions through the openai client.

Each session is a chat: a system prompt, a task with a long code context, then per turn the
model's reply, a tool output and a new question appended, so every turn repeats the whole history
(the prefix a cache can serve). Sessions run in parallel (`concurrency` at a time), the turns of
one session one after another. Each turn is a streaming chat request with usage; TTFT is the time
from sending it to the first chunk with text.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvstrata.agent_text import ACTIONS, LINE_TEMPLATES, NAMES, QUESTIONS, SYSTEM, TASKS


@dataclass(frozen=True)
class LoadSpec:
    sessions: int = 8
    turns: int = 4
    concurrency: int = 4
    first_lines: int = 60
    tool_lines: int = 30
    max_tokens: int = 16
    seed: int = 0


@dataclass
class TurnStat:
    session: int
    turn: int
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class LoadResult:
    turns: list[TurnStat] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def _lines(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        t = rng.choice(LINE_TEMPLATES)
        out.append(t.format(name=rng.choice(NAMES), i=rng.randrange(1000), j=rng.randrange(100)))
    return "\n".join(out)


def session_messages(spec: LoadSpec, s: int) -> tuple[list[dict[str, str]], random.Random]:
    rng = random.Random(spec.seed * 1000 + s)
    task = f"{rng.choice(TASKS)}\n\n{_lines(rng, spec.first_lines)}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}], rng


def _turn(
    client: Any, model: str, msgs: list[dict[str, str]], spec: LoadSpec, salt: str | None
) -> tuple[str, TurnStat]:
    extra = {"cache_salt": salt} if salt else {}
    t0 = time.perf_counter()
    ttft, text, use = None, [], None
    stream = client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=spec.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            use = chunk.usage
    e2e = time.perf_counter() - t0
    if use is None:
        raise RuntimeError("no usage chunk (stream_options.include_usage ignored?)")
    details = use.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    stat = TurnStat(
        0, 0, e2e if ttft is None else ttft, e2e, use.prompt_tokens, cached, use.completion_tokens
    )
    return "".join(text), stat


def run_session(
    client: Any,
    model: str,
    spec: LoadSpec,
    s: int,
    fresh_salts: bool,
    out: LoadResult,
    lock: threading.Lock,
    tick: Callable[[], None],
) -> None:
    """One session's turns in order; `fresh_salts`: a new cache_salt per turn (nothing shared)."""
    msgs, rng = session_messages(spec, s)
    for k in range(spec.turns):
        salt = uuid.uuid4().hex if fresh_salts else None
        try:
            reply, stat = _turn(client, model, msgs, spec, salt)
        except Exception as exc:  # noqa: BLE001 - counted as an error of this run
            with lock:
                out.errors.append(f"session {s} turn {k}: {type(exc).__name__}: {exc}")
            tick()
            return
        stat.session, stat.turn = s, k
        with lock:
            out.turns.append(stat)
        tick()
        msgs = next_messages(msgs, reply, rng, spec)


def next_messages(
    msgs: list[dict[str, str]], reply: str, rng: random.Random, spec: LoadSpec
) -> list[dict[str, str]]:
    """The next turn's chat: the reply with a tool call, its output and a new question."""
    action = rng.choice(ACTIONS).format(name=rng.choice(NAMES))
    tool = _lines(rng, spec.tool_lines)
    question = rng.choice(QUESTIONS).format(name=rng.choice(NAMES))
    return [
        *msgs,
        {"role": "assistant", "content": f"{reply}\n{action}"},
        {"role": "user", "content": f"Tool output:\n{tool}\n\n{question}"},
    ]


def run_load(
    url: str, model: str | None, spec: LoadSpec, fresh_salts: bool, tick: Callable[[], None]
) -> LoadResult:
    import openai

    client = openai.OpenAI(
        base_url=f"{url.rstrip('/')}/v1", api_key="none", max_retries=0, timeout=600
    )
    name = model or client.models.list().data[0].id
    out, lock = LoadResult(), threading.Lock()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(spec.concurrency) as pool:
        futs = [
            pool.submit(run_session, client, name, spec, s, fresh_salts, out, lock, tick)
            for s in range(spec.sessions)
        ]
        for f in futs:
            f.result()
    out.wall_s = time.perf_counter() - t0
    return out


def summarize(res: LoadResult) -> dict[str, Any]:
    ttfts = sorted(t.ttft_s for t in res.turns)
    prompt = sum(t.prompt_tokens for t in res.turns)
    return {
        "requests": len(res.turns),
        "errors": len(res.errors),
        "ttft_p50_s": _pct(ttfts, 0.50),
        "ttft_p90_s": _pct(ttfts, 0.90),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "tpot_p50_s": _pct(_tpots(res), 0.50),
        "output_tokens_per_s": sum(t.completion_tokens for t in res.turns) / res.wall_s
        if res.wall_s
        else 0.0,
        "hit_rate": sum(t.cached_tokens for t in res.turns) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "wall_s": res.wall_s,
        "ttft_by_turn_s": _by_turn(res),
        "error_messages": res.errors[:5],
    }


def _tpots(res: LoadResult) -> list[float]:
    """Per turn with 2+ output tokens, its time per output token after the first (vLLM's TPOT:
    (e2e - TTFT) / (output tokens - 1)), sorted."""
    return sorted(
        (t.e2e_s - t.ttft_s) / (t.completion_tokens - 1)
        for t in res.turns
        if t.completion_tokens > 1
    )


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _by_turn(res: LoadResult) -> list[float]:
    turns = sorted({t.turn for t in res.turns})
    out = []
    for k in turns:
        xs = sorted(t.ttft_s for t in res.turns if t.turn == k)
        out.append(xs[len(xs) // 2])
    return out

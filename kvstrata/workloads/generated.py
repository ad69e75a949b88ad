"""Generated workloads: SGLang-style multi-turn chat and coding-agent sessions.

Both produce `TraceRequest`s with explicit token segments (int32 arrays shared between the turns of a
session, so a 200k-token history costs its memory once). A turn's prompt is the previous turn's
prompt + the previous output + the new input, so the prefix cache sees real, growing reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstrata.configtools import doc
from kvstrata.workloads.trace import DEFAULT_VOCAB, Trace, TraceRequest

_SYSTEM, _USER, _OUTPUT, _CONTEXT, _TOOL = range(5)


def _tokens(seed: int, kind: int, a: int, b: int, n: int, vocab: int) -> np.ndarray:
    """[n] int32 deterministic token ids for segment (kind, a, b); PCG64 streams are stable."""
    rng = np.random.default_rng([seed, kind, a, b])
    return rng.integers(0, vocab, size=n, dtype=np.int32)


def _finish(rows: list[tuple[float, tuple[np.ndarray, ...], np.ndarray]], name: str) -> Trace:
    """Sort (arrival, segments, output) rows by arrival and number them."""
    rows.sort(key=lambda r: r[0])
    reqs = []
    for rid, (t, segs, out) in enumerate(rows):
        n_in = sum(len(s) for s in segs)
        reqs.append(TraceRequest(rid, t, n_in, len(out), segments=segs, output=out))
    if not reqs:
        raise ValueError(f"{name}: the configuration produces no requests")
    return Trace(reqs, source=name)


@dataclass(frozen=True)
class MultiTurnConfig:
    """SGLang-style multi-turn chat benchmark (clients x rounds)."""

    clients: int = doc(16, "concurrent chat clients")
    rounds: int = doc(5, "turns per client")
    request_length: int = doc(1024, "new user tokens per turn")
    output_length: int = doc(128, "output tokens per turn (part of the next turn's prompt)")
    request_rate: float = doc(4.0, "clients starting per second (Poisson)")
    think_time_s: float = doc(2.0, "mean seconds between a client's turns (exponential)")
    vocab_size: int = doc(DEFAULT_VOCAB, "token ids are drawn from [0, vocab_size)")
    seed: int = doc(0, "random seed")

    def __post_init__(self) -> None:
        for name in ("clients", "rounds", "request_length", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.output_length < 0 or self.request_rate <= 0 or self.think_time_s < 0:
            raise ValueError("output_length and think_time_s must be >= 0 and request_rate > 0")


def multi_turn(cfg: MultiTurnConfig) -> Trace:
    """Each client's round r prompt = its history + a new `request_length`-token message."""
    rng = np.random.default_rng([cfg.seed, 99])
    start = np.cumsum(rng.exponential(1.0 / cfg.request_rate, size=cfg.clients))
    rows = []
    for c in range(cfg.clients):
        t, history = float(start[c]), ()
        for r in range(cfg.rounds):
            user = _tokens(cfg.seed, _USER, c, r, cfg.request_length, cfg.vocab_size)
            segs = (*history, user)
            out = _tokens(cfg.seed, _OUTPUT, c, r, cfg.output_length, cfg.vocab_size)
            rows.append((t, segs, out))
            history = (*segs, out)
            t += float(rng.exponential(cfg.think_time_s)) if cfg.think_time_s else 0.0
    return _finish(rows, "multi_turn")


@dataclass(frozen=True)
class AgentConfig:
    """Coding-agent sessions: long histories that grow by tool output every turn."""

    sessions: int = doc(8, "agent sessions")
    turns: int = doc(12, "maximum turns per session (a session also ends at max_history)")
    system_prompts: int = doc(2, "distinct system prompts shared between sessions")
    system_prompt_tokens: int = doc(6000, "tokens of each shared system prompt")
    initial_context: tuple[int, int] = doc(
        (24000, 60000), "first-turn repository context, min max tokens"
    )
    tool_output: tuple[int, int] = doc(
        (1000, 12000), "tool output appended per turn, min max tokens"
    )
    model_output: tuple[int, int] = doc((100, 1500), "model output per turn, min max tokens")
    max_history: int = doc(200000, "a session ends before its prompt would exceed this")
    think_time_s: float = doc(5.0, "mean seconds between turns (tool run + agent), exponential")
    session_rate: float = doc(0.5, "sessions starting per second (Poisson)")
    vocab_size: int = doc(DEFAULT_VOCAB, "token ids are drawn from [0, vocab_size)")
    seed: int = doc(0, "random seed")

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "system_prompts", "max_history", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("initial_context", "tool_output", "model_output"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be (min, max) with 0 <= min <= max, got {(lo, hi)}")
        if self.system_prompt_tokens + self.initial_context[0] > self.max_history:
            raise ValueError("system_prompt_tokens + initial_context min exceeds max_history")
        if self.session_rate <= 0 or self.think_time_s < 0:
            raise ValueError("session_rate must be > 0 and think_time_s >= 0")


def _agent_session(cfg: AgentConfig, s: int, t0: float, rng: np.random.Generator) -> list:
    """Rows of one session: turn k's prompt = system + context + (output, tool) of turns < k."""
    sp = int(rng.integers(cfg.system_prompts))
    tok = lambda kind, b, n: _tokens(cfg.seed, kind, s, b, n, cfg.vocab_size)  # noqa: E731
    system = _tokens(cfg.seed, _SYSTEM, sp, 0, cfg.system_prompt_tokens, cfg.vocab_size)
    context = tok(
        _CONTEXT, 0, int(rng.integers(cfg.initial_context[0], cfg.initial_context[1] + 1))
    )
    segs: tuple[np.ndarray, ...] = (system, context)
    n_in, t, rows = len(system) + len(context), t0, []
    for k in range(cfg.turns):
        out = tok(_OUTPUT, k, int(rng.integers(cfg.model_output[0], cfg.model_output[1] + 1)))
        rows.append((t, segs, out))
        tool = tok(_TOOL, k, int(rng.integers(cfg.tool_output[0], cfg.tool_output[1] + 1)))
        n_in += len(out) + len(tool)
        if n_in > cfg.max_history:
            break
        segs = (*segs, out, tool)
        t += float(rng.exponential(cfg.think_time_s)) if cfg.think_time_s else 0.0
    return rows


def coding_agent(cfg: AgentConfig) -> Trace:
    """Sessions start as a Poisson process; each runs up to `turns` turns."""
    rng = np.random.default_rng([cfg.seed, 7])
    starts = np.cumsum(rng.exponential(1.0 / cfg.session_rate, size=cfg.sessions))
    rows = []
    for s in range(cfg.sessions):
        rows.extend(_agent_session(cfg, s, float(starts[s]), rng))
    return _finish(rows, "coding_agent")

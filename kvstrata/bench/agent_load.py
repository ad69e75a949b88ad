"""The load of `kvstrata bench agent`: agent sessions with tool-call gaps, hinted three ways.

Session s is the held-out trace's session s (kvstrata.workloads.heldout_trace: each turn resends
the whole history plus a tool call, its output and a question) behind the system prompt every
session of the agent shares (instructions, tool definitions, a repository map:
kvstrata.workloads.agent_prefix). After each turn the session's tool runs for a gap drawn from
the Mooncake trace's inter-turn gaps, scaled (kvstrata.workloads.turn_gaps), and a hinted
session's `hinted_gap_x` times that (its tools run long): 90% of the gap is the tool, then 10%
writing the next turn. Each turn records how many other turns were in flight when it was sent. An arm says what the sessions tell the server:
- `none`: nothing;
- `pins`: every turn's history carries `cache_control` (its last message, so the whole prompt);
- `pins_prefetch`: that, and a `POST /v1/kv/prefetch` of the next turn's history when the tool
  ends.
Only the last `hinted_sessions` sessions send hints (in the hinted arms); the rest never do:
their traffic is what pushes a hinted session's pages out under plain recency, and their TTFT
shows what the others' pins cost them. They start first (they were running when the hinted
sessions arrive) and may differ in size (`unhinted_first_lines`, `unhinted_turns`). Each turn
streams with usage; TTFT is sending to the first chunk with text.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx

from kvstrata.agent_text import session_messages
from kvstrata.workloads.agent_prefix import agent_system_prompt
from kvstrata.workloads.heldout_trace import HELDOUT_SEED
from kvstrata.workloads.turn_gaps import GapSampler

ARMS = ("none", "pins", "pins_prefetch")
TOOL_SHARE = 0.9  # of a gap: the tool runs, then the next turn is written
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class AgentSpec:
    sessions: int  # the last `hinted_sessions` of them send hints (in the hinted arms)
    hinted_sessions: int
    turns: int  # of a hinted session
    unhinted_turns: int
    map_lines: int  # lines of code in the system prompt every session shares (~20 tokens a line)
    first_lines: int  # lines of code in a hinted session's first turn, after the system prompt
    unhinted_first_lines: int
    tool_lines: int  # lines of tool output each later turn adds
    max_tokens: int
    gap_scale: float  # trace gaps (seconds) x this = the tool call's seconds
    gap_cap_s: float
    start_every_s: float  # sessions of a kind start this far apart
    hinted_start_s: float  # the first hinted session starts this long after the first unhinted
    page_size: int
    device_pages: int
    host_pages: int
    storage_read_s_per_page: float  # emulated remote store: each page read waits this long
    seed: int = 0
    rounds: int = 1  # the three arms run this many times in turn; each arm's turns pooled
    hinted_gap_x: float = 1.0  # a hinted session's tool calls run this many times the others'
    prefill_order: str = "shortest"  # the servers' --prefill-order

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.hinted_gap_x <= 0:
            raise ValueError(f"hinted_gap_x must be > 0, got {self.hinted_gap_x}")
        if not 0 < self.hinted_sessions < self.sessions:
            raise ValueError(
                f"sessions ({self.sessions}) must be more than hinted_sessions "
                f"({self.hinted_sessions}), and hinted_sessions at least 1"
            )

    def hinted(self, session: int) -> bool:
        return session >= self.sessions - self.hinted_sessions

    def tool_gap_s(self, sampler: GapSampler, session: int, turn: int) -> float:
        """The tool call after the session's turn: a hinted session's runs `hinted_gap_x` times
        a drawn gap (agents' builds and test suites), the others' the drawn gap."""
        gap = sampler.gap(session, turn)
        return gap * self.hinted_gap_x if self.hinted(session) else gap

    def start_s(self, session: int) -> float:
        """Unhinted sessions start first, `start_every_s` apart; hinted ones from
        `hinted_start_s` on."""
        first_hinted = self.sessions - self.hinted_sessions
        if not self.hinted(session):
            return self.start_every_s * session
        return self.hinted_start_s + self.start_every_s * (session - first_hinted)


@dataclass
class Turn:
    session: int
    turn: int
    hinted: bool
    ttft_s: float
    prompt_tokens: int
    by_tier: dict[str, int]
    pinned_tokens: int
    in_flight: int = 0  # other turns outstanding when this one was sent
    sent_s: float = 0.0  # when it was sent, from the arm's start
    new_tokens: int = 0  # prompt tokens past the session's previous prompt (all: first turn)
    round: int = 0  # which run of its arm (AgentSpec.rounds)


@dataclass
class ArmResult:
    turns: list[Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hints: int = 0
    wall_s: float = 0.0
    outstanding: int = 0  # turns sent and not answered yet (under the lock)
    started: float = field(default_factory=time.perf_counter)  # the arm's start (perf_counter)

    def add(self, other: ArmResult, round_: int) -> None:
        """Pool another run of the same arm into this one (its turns marked with `round_`)."""
        for turn in other.turns:
            turn.round = round_
        self.turns += other.turns
        self.errors += other.errors
        self.hints += other.hints
        self.wall_s += other.wall_s


def conversations(spec: AgentSpec, session: int) -> list[list[dict[str, str]]]:
    """The session's prompt per turn (the held-out trace's session, whole history each turn),
    opening with the system prompt every session shares (kvstrata.workloads.agent_prefix)."""
    rng = random.Random(HELDOUT_SEED + session)
    system = {"role": "system", "content": agent_system_prompt(spec.map_lines)}
    hinted = spec.hinted(session)
    first = spec.first_lines if hinted else spec.unhinted_first_lines
    turns = spec.turns if hinted else spec.unhinted_turns
    convo = session_messages(rng, first, spec.tool_lines, turns)
    return [[system, *msgs[1:]] for msgs in convo]


def marked(msgs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The chat with `cache_control` on its last message: the whole history is to be kept."""
    last = msgs[-1]
    part = {"type": "text", "text": last["content"], "cache_control": {"type": "ephemeral"}}
    return [*msgs[:-1], {"role": last["role"], "content": [part]}]


def run_arm(url: str, spec: AgentSpec, arm: str, sampler: GapSampler) -> ArmResult:
    """Every session in parallel (agents do), started apart, each turn after its tool call."""
    assert arm in ARMS, arm
    out, lock = ArmResult(), threading.Lock()
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        with ThreadPoolExecutor(spec.sessions) as pool:
            futs = [
                pool.submit(_session, client, spec, arm, sampler, s, out, lock)
                for s in range(spec.sessions)
            ]
            for f in futs:
                f.result()
    out.wall_s = time.perf_counter() - out.started
    return out


def _session(
    client: httpx.Client,
    spec: AgentSpec,
    arm: str,
    sampler: GapSampler,
    s: int,
    out: ArmResult,
    lock: threading.Lock,
) -> None:
    hinted = arm != "none" and spec.hinted(s)
    convo = conversations(spec, s)
    time.sleep(spec.start_s(s))  # sessions start apart, as agents do
    last_prompt = 0
    for k, msgs in enumerate(convo):
        sent_s = time.perf_counter() - out.started
        with lock:
            in_flight = out.outstanding
            out.outstanding += 1
        try:
            turn = _turn(client, spec, msgs if not hinted else marked(msgs), s, k)
        except Exception as exc:  # noqa: BLE001 - counted as an error of this arm
            with lock:
                out.outstanding -= 1
                out.errors.append(f"session {s} turn {k}: {type(exc).__name__}: {exc}")
            return
        turn.hinted, turn.in_flight, turn.sent_s = spec.hinted(s), in_flight, sent_s
        turn.new_tokens, last_prompt = turn.prompt_tokens - last_prompt, turn.prompt_tokens
        with lock:
            out.outstanding -= 1
            out.turns.append(turn)
        if k + 1 == len(convo):
            return
        gap = spec.tool_gap_s(sampler, s, k)
        time.sleep(gap * TOOL_SHARE)  # the tool runs
        if hinted and arm == "pins_prefetch":
            _prefetch(client, convo[k + 1][:-1])  # the history, before the new question
            with lock:
                out.hints += 1
        time.sleep(gap * (1 - TOOL_SHARE))


def _turn(client: httpx.Client, spec: AgentSpec, msgs: list[Any], s: int, k: int) -> Turn:
    body = {
        "messages": msgs,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, usage = None, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if (
                ttft is None
                and chunk.get("choices")
                and chunk["choices"][0]["delta"].get("content")
            ):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("no usage chunk")
    details = usage["prompt_tokens_details"]
    return Turn(
        s, k, True, ttft if ttft is not None else time.perf_counter() - t0,
        usage["prompt_tokens"], details["cached_tokens_by_tier"], details["pinned_tokens"],
    )  # fmt: skip


def _prefetch(client: httpx.Client, msgs: list[dict[str, str]]) -> None:
    r = client.post("/v1/kv/prefetch", json={"messages": msgs})
    if r.status_code != 200:
        raise RuntimeError(f"prefetch: HTTP {r.status_code}: {r.text[:300]}")

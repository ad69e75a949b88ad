"""The held-out agent trace (vLLM's custom dataset JSONL): deterministic bytes, turn-major order,
each turn resending the whole history, sessions apart from every tuned or trained one; with the
SmolLM2 chat template, each turn's tokens (less the assistant prompt) lead the next turn's."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstrata.agent_text import session_messages
from kvstrata.model.nextn_data import AGENT_SEED
from kvstrata.workloads.heldout_trace import TraceSpec, trace_rows, write_trace

SPEC = TraceSpec(sessions=3, turns=4, first_lines=5, tool_lines=3, output_tokens=7)
ASSISTANT = "<assistant>"


def render(msgs: Sequence[dict[str, str]]) -> str:
    """A chat template in miniature: role tags, then the assistant prompt."""
    return "".join(f"<{m['role']}>{m['content']}\n" for m in msgs) + ASSISTANT


def test_rows_are_deterministic_turn_major_and_grow_by_whole_history(tmp_path: Path) -> None:
    rows = trace_rows(SPEC, render)
    a = write_trace(tmp_path / "a.jsonl", rows).read_bytes()
    assert a == write_trace(tmp_path / "b.jsonl", trace_rows(SPEC, render)).read_bytes()
    lines = [json.loads(line) for line in a.decode().splitlines()]
    assert lines == rows and len(rows) == SPEC.sessions * SPEC.turns
    assert all(set(r) == {"prompt", "output_tokens"} and r["output_tokens"] == 7 for r in rows)
    for s in range(SPEC.sessions):
        turns = [str(rows[k * SPEC.sessions + s]["prompt"]) for k in range(SPEC.turns)]
        for prev, nxt in zip(turns, turns[1:], strict=False):
            history = prev.removesuffix(ASSISTANT)
            assert nxt.startswith(history) and len(nxt) > len(prev)
    firsts = [str(r["prompt"]) for r in rows[: SPEC.sessions]]
    assert len(set(firsts)) == SPEC.sessions  # every session its own text


def _task(seed: int) -> str:
    """The code context of the session drawn from Random(seed)."""
    return session_messages(random.Random(seed), SPEC.first_lines, 1, 1)[0][1]["content"]


def test_sessions_are_held_out_from_workload_serve_load_and_training() -> None:
    rows = trace_rows(SPEC, render)
    used = [s * 1_000_003 + i for s in range(3) for i in range(16)]  # workloads.agent
    used += [s * 1000 + i for s in range(3) for i in range(16)]  # bench serve's load
    used += [AGENT_SEED + i for i in range(256)]  # NextN training split
    tasks = {_task(seed) for seed in used}
    for row in rows[: SPEC.sessions]:
        assert not any(t in str(row["prompt"]) for t in tasks)


def test_spec_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        TraceSpec(sessions=0)


@pytest.mark.slow
def test_smollm2_turns_lead_the_next_turn_in_tokens() -> None:
    from kvstrata.model.smollm2 import ensure_smollm2
    from kvstrata.model.tokenizer import Tokenizer

    tok = Tokenizer(ensure_smollm2())
    rows = trace_rows(SPEC, tok.render_chat)
    gen = tok.encode("<|im_start|>assistant\n")  # the template's assistant prompt
    for s in range(SPEC.sessions):
        ids = [tok.encode(str(rows[k * SPEC.sessions + s]["prompt"])) for k in range(SPEC.turns)]
        for prev, nxt in zip(ids, ids[1:], strict=False):
            assert prev[-len(gen) :] == gen and nxt[: len(prev) - len(gen)] == prev[: -len(gen)]

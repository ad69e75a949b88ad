"""The system prompt every session of a coding agent opens with: its instructions, its tool
definitions and a map of the repository.

Agent frameworks send the same long system prompt (instructions and tool schemas, thousands of
tokens) at the head of every session, and the session's own task and history after it; that
shared head is what makes a session's first turn cheap on a warm cache, and it is the part of a
history every session hits. The text is a pure function of `map_lines` (a fixed seed, apart from
every session's): the same bytes in every session, arm and run.
"""

from __future__ import annotations

import random

from kvstrata.agent_text import SYSTEM, lines

PREFIX_SEED = 8_999_999
"""The repository map draws from Random(PREFIX_SEED): no session's seed (kvstrata.workloads)."""

TOOL_DEFINITIONS = (
    "run_tests(path: str, flags: str = '-q') -> str: run pytest on a path; returns its output",
    "read_file(path: str, start: int = 1, end: int = -1) -> str: the file's lines start..end",
    "write_file(path: str, text: str) -> str: replace a file's text; returns a diff summary",
    "grep(pattern: str, path: str = '.') -> str: lines matching a regular expression, with paths",
    "run_shell(cmd: str, timeout_s: int = 60) -> str: run a command; its stdout and stderr",
    "list_dir(path: str = '.') -> str: the entries of a directory, one per line",
    "git_diff(rev: str = 'HEAD') -> str: the working tree's changes against a revision",
)


def agent_system_prompt(map_lines: int) -> str:
    """Instructions, then the tools, then `map_lines` lines of the repository's code."""
    tools = "\n".join(f"- {t}" for t in TOOL_DEFINITIONS)
    code = lines(random.Random(PREFIX_SEED), map_lines)
    return f"{SYSTEM}\n\nTools (call one per turn):\n{tools}\n\nRepository map:\n{code}"

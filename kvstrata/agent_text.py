"""The text of a coding-agent session: system prompt, task, code-like lines, tool calls, tool
output and questions, drawn from fixed vocabularies with a caller's seeded RNG.

Pure text (no tokenizer, no engine): the replayed agent workload (kvstrata.workloads.agent)
renders it through a chat template, and the NextN trainer (kvstrata.model.nextn_data) draws
sessions from other seeds as training text resembling what the workload serves.
"""

from __future__ import annotations

import random

SYSTEM = (
    "You are a coding agent working in a Python repository. Use tools, read their output "
    "carefully and answer with the next action."
)
TASKS = (
    "The test suite fails after the cache refactor. Find the bug and fix it.",
    "Add a size limit to the file store and make eviction least-recently-used.",
    "The server leaks memory under load. Find where pages are never freed.",
    "Port the tokenizer wrapper to the new chat template API and keep tests green.",
)
ACTIONS = (
    "run_tests(path='tests/', flags='-x -q')",
    "read_file(path='kvstrata/cache/{name}.py')",
    "grep(pattern='def {name}', path='kvstrata/')",
    "run_shell(cmd='python -m kvstrata.{name} --check')",
)
QUESTIONS = (
    "What does this output tell you about {name}? What do you do next?",
    "Is {name} the cause? Explain briefly and pick the next tool call.",
    "Which line should change in {name}, and why?",
)
NAMES = ("allocator", "radix", "tiers", "manager", "movers", "policies", "file_store", "engine")
LINE_TEMPLATES = (
    "def {name}_{i}(self, pages: list[int], key: int) -> int:",
    "    if self.{name}.num_free < {i}:",
    "        raise ValueError(f'{name}: need {i} pages, have {{n}}')",
    "    return self.{name}.alloc({i})",
    "    for page in range({i}):",
    "        self.table[page] = self.{name}.lookup(page + {i})",
    "tests/test_{name}.py::test_case_{i} FAILED",
    "E   AssertionError: expected {i} pages, got {j}",
    'File "kvstrata/{name}.py", line {i}, in step',
    "{name}: {i} hits, {j} misses, {i}.{j} ms",
    "import {name}  # noqa: F401",
    "    assert len(self.{name}) == {j}, 'invariant broken'",
)


def line(rng: random.Random) -> str:
    template = rng.choice(LINE_TEMPLATES)
    return template.format(name=rng.choice(NAMES), i=rng.randrange(1000), j=rng.randrange(100))


def lines(rng: random.Random, n: int) -> str:
    return "\n".join(line(rng) for _ in range(n))


def session_messages(
    rng: random.Random, first_lines: int, tool_lines: int, turns: int
) -> list[list[dict[str, str]]]:
    """Per turn, the whole conversation so far (the history only grows): a task with
    `first_lines` lines of code, then per turn the agent's call, `tool_lines` lines of its
    output and a question."""
    task = rng.choice(TASKS)
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{task}\n\n{lines(rng, first_lines)}"},
    ]
    out = []
    for _ in range(turns):
        name = rng.choice(NAMES)
        action = rng.choice(ACTIONS).format(name=name)
        msgs = msgs + [
            {"role": "assistant", "content": f"Calling {action}"},
            {"role": "user", "content": f"Tool output:\n{lines(rng, tool_lines)}"},
            {"role": "user", "content": rng.choice(QUESTIONS).format(name=name)},
        ]
        out.append(list(msgs))
    return out

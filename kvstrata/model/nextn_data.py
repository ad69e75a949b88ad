"""Distillation data for a NextN layer: the target's own hidden states and choices.

Each training text (a prompt) is run through the target once as a batched prefill, then continued
by the target's own greedy tokens (the inputs decoding feeds the draft). Every position j of the
result gives, from that one pass, the target's hidden state h_j [hidden] (before the final norm)
and its greedy choice y_j (the token after t_j). NextN entry j takes (t_j, h_{j-1}) and learns
y_j (kvstrata.model.nextn_train), on the continuation's rows only (`prompt_lens` marks where
they start): decoding drafts there alone, and the greedy text a target writes differs from the
prompts it reads.

The texts for SmolLM2 (`smollm2_prompts`) are chat prompts (tasks x topics) and coding-agent
sessions drawn by kvstrata.agent_text with seeds AGENT_SEED + i: a training split apart from
the replayed workload's sessions (kvstrata.workloads.agent seeds its RNGs with
seed * 1_000_003 + session, seed 0 in `kvstrata bench spec` and `kvstrata run`), so the bench
measures sessions the layer never saw.

The data is cached next to the layer (`Distilled.save`/`load`, safetensors), keyed by the
target and the prompts (`data_key`), so a retraining with other settings skips the target.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import tempfile
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file

from kvstrata.agent_text import session_messages
from kvstrata.memory.pool import DevicePool
from kvstrata.model.decoder import DecoderLM, SeqBatch
from kvstrata.model.tokenizer import Tokenizer

TASKS = [
    "Explain {} to a beginner in a few sentences.",
    "Write a short Python function related to {}, with a docstring.",
    "List five facts about {}.",
    "Summarize the main ideas of {} in one paragraph.",
    "What are common mistakes people make with {}? Answer briefly.",
    "Write a short story that involves {}.",
]
TOPICS = [
    "sorting algorithms", "the water cycle", "HTTP caching", "photosynthesis", "binary search",
    "the French Revolution", "unit testing", "climate change", "hash tables", "volcanoes",
    "recursion", "healthy breakfast", "git branches", "the solar system", "JSON parsing",
    "time management", "linked lists", "the immune system", "regular expressions", "gardening",
]  # fmt: skip
PROMPTS = [t.format(x) for x in TOPICS for t in TASKS]  # 120 chat prompts
AGENT_SEED = 7_000_001  # training sessions: Random(AGENT_SEED + i), apart from the workload's
DATA_VERSION = 2  # bumped when Distilled's fields change (2: prompt_lens)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which texts the target continues, and how far."""

    chat_prompts: int = 120
    """How many of PROMPTS (in order) are used."""
    agent_sessions: int = 272
    """Coding-agent sessions (each: 4-16 lines of code, 1-3 turns of 3-10 tool-output lines).
    136 -> 272 raised the trained layer's held-out acceptance (`kvstrata bench spec`, full
    workload, cold) 0.577 -> 0.632 at 360 steps: the data, not the steps, was the limit."""
    new_tokens: int = 128
    """Greedy tokens the target adds to each prompt (a reply's length: drafts late in a long
    reply are as many as early ones)."""
    batch: int = 32
    """Prompts per batched prefill / decode."""


@dataclasses.dataclass
class Distilled:
    """Sequences back to back: sequence i is rows starts[i] .. starts[i+1] - 1."""

    tokens: torch.Tensor  # [N] int64: t_j
    hidden: torch.Tensor  # [N, hidden] fp32: the target's h_j (before the final norm)
    labels: torch.Tensor  # [N] int64: the target's greedy choice y_j (the token after t_j)
    starts: torch.Tensor  # [S + 1] int64
    prompt_lens: torch.Tensor  # [S] int64: rows of sequence i before its continuation

    def save(self, path: Path) -> None:
        """Written atomically (a concurrent builder that won leaves equal bytes)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        save_file({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, tmp)
        os.replace(tmp, path)

    def bounds(self) -> list[tuple[int, int, int]]:
        """(first row, end row, prompt rows) of each sequence."""
        ends = (self.starts[:-1].tolist(), self.starts[1:].tolist(), self.prompt_lens.tolist())
        return list(zip(*ends, strict=True))

    @classmethod
    def load(cls, path: Path) -> Distilled:
        return cls(**load_file(str(path)))


def smollm2_prompts(model_dir: Path, cfg: DataConfig) -> list[list[int]]:
    """Chat prompts, then agent sessions (module docstring), rendered by the chat template."""
    tok = Tokenizer(model_dir)
    out = [tok.encode_chat(p) for p in PROMPTS[: cfg.chat_prompts]]
    for i in range(cfg.agent_sessions):
        rng = random.Random(AGENT_SEED + i)
        first, tool, turns = rng.randint(4, 16), rng.randint(3, 10), rng.randint(1, 3)
        out.append(tok.encode_chat(session_messages(rng, first, tool, turns)[-1]))
    return out


def data_key(target: DecoderLM, prompts: list[list[int]], cfg: DataConfig) -> str:
    """Identity of the data: the target's weights, the prompts' ids and the continuation length."""
    h = xxhash.xxh3_128()
    h.update(f"{DATA_VERSION}|{target.fingerprint}|{cfg.new_tokens}|".encode())
    for p in prompts:
        h.update(torch.tensor(p, dtype=torch.int64).numpy().tobytes() + b"|")
    return h.hexdigest()


@torch.no_grad()
def distill(target: DecoderLM, prompts: list[list[int]], cfg: DataConfig) -> Distilled:
    """The target's states and choices over each prompt and its greedy continuation."""
    seqs: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    for first in range(0, len(prompts), cfg.batch):
        seqs += _continue(target, prompts[first : first + cfg.batch], cfg.new_tokens)
    lens = [len(t) for t, _, _ in seqs]
    return Distilled(
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        tokens=torch.tensor([t for s, _, _ in seqs for t in s], dtype=torch.int64),
        hidden=torch.cat([h for _, h, _ in seqs]).float().contiguous(),
        labels=torch.cat([y for _, _, y in seqs]),
        starts=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64),
    )


def _choices(target: DecoderLM, h: torch.Tensor) -> torch.Tensor:
    """The target's greedy choice at each row of h [T, hidden] (the head in row chunks)."""
    return torch.cat([target.head(h[i : i + 512]).argmax(-1) for i in range(0, h.shape[0], 512)])


def _continue(
    target: DecoderLM, prompts: list[list[int]], new: int
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Per prompt: (tokens t_0 .. t_{L+new-1}, h [L+new, hidden], y [L+new]); t_{j+1} = y_j
    past the prompt."""
    page = 16
    per = math.ceil((max(map(len, prompts)) + new) / page)
    pool = DevicePool(target.kv_shape(page), per * len(prompts))
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    states: list[torch.Tensor] = []
    batch = SeqBatch.build(prompts, [0] * len(prompts), tables)
    target(batch, pool, last_only=True, hidden_out=states)
    rows = list(states[0].split([len(p) for p in prompts]))  # each [L, hidden]
    hs = [[r] for r in rows]
    ys = [[_choices(target, r)] for r in rows]
    toks = [list(p) for p in prompts]
    for _ in range(new):
        for t, y in zip(toks, ys, strict=True):
            t.append(int(y[-1][-1]))
        states = []
        batch = SeqBatch.build([[t[-1]] for t in toks], [len(t) - 1 for t in toks], tables)
        logits = target(batch, pool, last_only=True, hidden_out=states)  # [seqs, vocab]
        for i, (h, y) in enumerate(zip(hs, ys, strict=True)):
            h.append(states[0][i : i + 1])
            y.append(logits[i : i + 1].argmax(-1))
    return [(t, torch.cat(h), torch.cat(y)) for t, h, y in zip(toks, hs, ys, strict=True)]

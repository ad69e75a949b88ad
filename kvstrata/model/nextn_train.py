"""Train a NextN layer for a target that ships none, distilled from the target itself, on CPU.

Data: the target's own greedy continuations of varied chat prompts (PROMPTS: tasks x topics),
then one teacher-forced forward of each whole sequence gives the target's hidden states h
[T, hidden] (before the final norm) and its greedy choice at every position. Entry j of the
head takes (t_j, h_{j-1}) and learns the target's choice at j (the token after t_j): exactly
what speculative decoding asks of it (it is verified against those choices).

Init: the layer is a copy of the target's last decoder layer and the norm the target's final
norm; eh_proj passes the state through and reads the embedding with small seeded weights, so
the head starts from "the target's last step applied once more" and learns the shift by one.
Seeded (TrainConfig.seed) and single-threaded while training: the same bytes every build.
The result is written atomically (a concurrent builder that won leaves an equal file).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from kvstrata.memory.pool import DevicePool
from kvstrata.model.decoder import DecoderLM, SeqBatch
from kvstrata.model.mtp import MTPHead
from kvstrata.model.smollm2 import MODEL_NAME
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
PROMPTS = [t.format(x) for x in TOPICS for t in TASKS]  # 120 prompts


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How a NextN layer is trained here (defaults: about 3-5 minutes on 1 CPU core)."""

    seed: int = 1234
    """Seeds the eh_proj init and the order of training sequences."""
    prompts: int = 96
    """How many of PROMPTS (in order) are continued by the target."""
    new_tokens: int = 48
    """Greedy tokens the target adds to each prompt."""
    steps: int = 240
    """Optimizer steps (one sequence each)."""
    lr: float = 1e-3
    """AdamW learning rate (cosine decay to 0)."""


def can_train(model_dir: Path) -> bool:
    """A NextN layer is built automatically for SmolLM2 (the model this project ships)."""
    return Path(model_dir).name == MODEL_NAME


def greedy_continuations(target: DecoderLM, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Each prompt + the target's `new` greedy tokens (batched, on a scratch pool)."""
    page = 16
    per = math.ceil((max(map(len, prompts)) + new) / page)
    pool = DevicePool(target.kv_shape(page), per * len(prompts))
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    batch = SeqBatch.build(seqs, [0] * len(seqs), tables)
    for step in range(new):
        nxt = torch.argmax(target(batch, pool, last_only=True), dim=-1).tolist()
        for s, t in zip(seqs, nxt, strict=True):
            s.append(int(t))
        if step + 1 < new:
            batch = SeqBatch.build([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], tables)
    return seqs


def teacher_states(target: DecoderLM, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [T, hidden] before the final norm, the target's greedy choice at each position [T])."""
    page = 16
    pool = DevicePool(target.kv_shape(page), math.ceil(len(seq) / page))
    states: list[torch.Tensor] = []
    batch = SeqBatch.build([seq], [0], [list(range(pool.capacity))])
    logits = target(batch, pool, hidden_out=states)
    return states[0].clone(), torch.argmax(logits, dim=-1)


def head_train_logits(head: MTPHead, seq: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The head's logits [T, vocab] over a whole sequence with causal attention (autograd on):
    entry j takes (seq[j], h[j-1]), entry 0 a zero state. Equals MTPHead.forward's rows."""
    target = head.target[0]
    prev = torch.cat([torch.zeros_like(h[:1]), h[:-1]])  # [T, hidden]
    emb = target.model.embed_tokens(seq)
    x = head.eh_proj(torch.cat([head.enorm(emb), head.hnorm(prev)], dim=-1))
    layer, attn = head.layer, head.layer.self_attn
    cos, sin = target.rotary.tables(torch.arange(seq.shape[0]), x.dtype)
    q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)  # [T, heads|kv_heads, dim]
    o = nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )  # [heads, T, dim]
    x = x + attn.o_proj(o.transpose(0, 1).reshape(seq.shape[0], -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    weight = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    return nn.functional.linear(head.norm(x), weight)


def init_head(target: DecoderLM, seed: int) -> MTPHead:
    """The head's starting point (module docstring), trainable."""
    head = MTPHead(target)
    head.layer.load_state_dict(target.model.layers[-1].state_dict())
    head.norm.load_state_dict(target.model.norm.state_dict())
    hidden = target.spec.hidden_size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = torch.randn(hidden, hidden, generator=gen) * 0.02
        head.eh_proj.weight.copy_(torch.cat([w, torch.eye(hidden)], dim=1))
    head.requires_grad_(True)
    return head


def _train(
    head: MTPHead, data: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], cfg: TrainConfig
) -> None:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(cfg.seed)
    perm: list[int] = []
    for step in range(cfg.steps):
        if not perm:
            perm = torch.randperm(len(data), generator=order).tolist()
        seq, h, labels = data[perm.pop()]
        for group in opt.param_groups:
            group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        loss = nn.functional.cross_entropy(head_train_logits(head, seq, h), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 40 == 0 or step == cfg.steps - 1:
            print(f"kvstrata: nextn step {step} loss {float(loss.detach()):.3f}", file=sys.stderr)


def chat_prompts(model_dir: Path, cfg: TrainConfig) -> list[list[int]]:
    """The first cfg.prompts of PROMPTS, as the checkpoint's chat template renders them."""
    tok = Tokenizer(model_dir)
    return [tok.encode_chat(p) for p in PROMPTS[: cfg.prompts]]


def train_nextn(
    target: DecoderLM, prompts: list[list[int]], out: Path, cfg: TrainConfig = TrainConfig()
) -> Path:
    """Build a NextN layer of `target` from its continuations of `prompts`; save it at `out`."""
    print(f"kvstrata: training a NextN draft layer at {out} (once, minutes)", file=sys.stderr)
    started, threads = time.monotonic(), torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order, so the same bytes, on every machine
    try:
        with torch.no_grad():
            seqs = greedy_continuations(target, prompts, cfg.new_tokens)
            data = []
            for s in seqs:
                h, labels = teacher_states(target, s)
                data.append((torch.tensor(s), h, labels))
        head = init_head(target, cfg.seed)
        _train(head, data, cfg)
    finally:
        torch.set_num_threads(threads)
    head.requires_grad_(False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, tmp)
    os.replace(tmp, out)
    print(f"kvstrata: NextN layer at {out} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return out

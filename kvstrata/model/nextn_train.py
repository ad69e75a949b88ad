"""Train a NextN layer for a target that ships none, distilled from the target itself, on CPU.

Data (kvstrata.model.nextn_data): the target's hidden states h_j and greedy choices y_j over
its prompts and its own greedy continuations of them. Entry j of the head takes (t_j, h_{j-1})
and learns y_j: exactly what speculative decoding asks of it (it is verified against y). Only
the continuation's rows are scored (drafts are made there alone); the prompt's rows before
them are the window's context.

Chained drafts (`depth` 2): at decode time the head's 2nd draft takes its own output g_c in
place of the unknown h_c (kvstrata.engine.mtp_speculator). A second pass trains that: entry j
takes (t_j, g_{j-1}) with g from the first pass (no gradient through it) and learns y_j, its
query seeing the first pass's keys before j and its own key, as the draft's KV holds them then.

Reduced vocabulary: the head scores only the `vocab` target ids chosen most often on the
scored rows (MTPHead.set_vocab; ids ranked by count, ties by id). Rows whose choice lies
outside are left out of the loss. The draft pass then reads that share of the shared output head.

Training: windows of `window` consecutive entries ending at each sequence's end, then every
`window` rows back while they reach the continuation (absolute positions, causal attention
inside the window), `batch` windows per AdamW step, cosine learning rate. Init: the layer is a
copy of the target's last decoder layer, the norm the target's final norm, hnorm's weight the
mean RMS of h (so hnorm(h) has h's scale, as the copied layer expects) and eh_proj passes the
state through while reading the embedding with small seeded weights.

Seeded (TrainConfig.seed) and single-threaded while building: the same bytes every build.
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

from kvstrata.model.decoder import DecoderLM
from kvstrata.model.mtp import MTPHead
from kvstrata.model.nextn_data import DataConfig, Distilled, data_key, distill
from kvstrata.model.smollm2 import MODEL_NAME

IGNORE = -100  # a row that is padding, or whose target choice lies outside the head's vocab


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How a NextN layer is trained here (the defaults: SmolLM2's, minutes on 1 CPU core)."""

    seed: int = 1234
    """Seeds the eh_proj init and the order of training windows."""
    data: DataConfig = DataConfig()
    """The texts the target continues (kvstrata.model.nextn_data)."""
    vocab: int = 4096
    """Target ids the head scores (the most frequent choices of the data); 0: all."""
    window: int = 192
    """Entries per training window."""
    batch: int = 8
    """Windows per optimizer step."""
    steps: int = 540
    """Optimizer steps. SmolLM2, the held-out agent workload of `kvstrata bench spec`
    (acceptance of 1 draft, cold; full workload / its timed rounds / quick): with 136 agent
    sessions 120 steps 0.501 / 0.560 / 0.614, 360 steps 0.577 / 0.682 / 0.748, 720 steps
    0.561 / 0.681 / 0.753 (the loss falls on, the held-out acceptance does not); with 272
    (the default data) 360 steps 0.632 / 0.739 / 0.783, 540 steps 0.640 / 0.751 / 0.794."""
    lr: float = 3e-3
    """AdamW peak learning rate (cosine decay to 0)."""
    depth: int = 2
    """Draft depths trained: 1, the entry takes the target's state; 2, also the head's own
    output (the 2nd draft of a chain)."""


def can_train(model_dir: Path) -> bool:
    """A NextN layer is built automatically for SmolLM2 (the model this project ships)."""
    return Path(model_dir).name == MODEL_NAME


KV = tuple[torch.Tensor, torch.Tensor]  # a pass's keys and values [B, kv_heads, W, dim]


def head_train_hidden(
    head: MTPHead,
    tokens: torch.Tensor,
    prev: torch.Tensor,
    positions: torch.Tensor,
    earlier: KV | None = None,
) -> tuple[torch.Tensor, KV]:
    """The head's outputs g [B, W, hidden] over windows (autograd on) and the pass's (K, V):
    entry (b, w) takes token tokens[b, w] [B, W] at positions[b, w] and state prev[b, w]
    [B, W, hidden]. Without `earlier` it attends causally inside its window (MTPHead.forward's
    g over the same entries); with an earlier pass's (K, V) entry w sees that pass's keys
    before w and its own key (a chained draft's view of the draft KV)."""
    target, (b, w) = head.target[0], tokens.shape
    emb = target.model.embed_tokens(tokens.reshape(-1))  # [B*W, hidden]
    x = head.eh_proj(torch.cat([head.enorm(emb), head.hnorm(prev.reshape(b * w, -1))], dim=-1))
    layer, attn = head.layer, head.layer.self_attn
    cos, sin = target.rotary.tables(positions.reshape(-1), x.dtype)
    q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)  # [B*W, heads|kv_heads, dim]
    q, k, v = (t.view(b, w, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [B, h, W, dim]
    sdpa = nn.functional.scaled_dot_product_attention
    if earlier is None:
        o = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    else:
        mask = torch.cat([torch.ones(w, w, dtype=torch.bool).tril(-1), torch.eye(w).bool()], 1)
        keys, values = torch.cat([earlier[0], k], 2), torch.cat([earlier[1], v], 2)
        o = sdpa(q, keys, values, attn_mask=mask, enable_gqa=True)  # [B, h, W, dim]
    x = x + attn.o_proj(o.transpose(1, 2).reshape(b * w, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x.view(b, w, -1), (k, v)


def head_train_logits(head: MTPHead, seq: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The head's logits [T, vocab] over one whole sequence seq [T] with target states h
    [T, hidden]: entry j takes (seq[j], h[j-1]), entry 0 a zero state (MTPHead.forward's rows)."""
    prev = torch.cat([torch.zeros_like(h[:1]), h[:-1]])  # [T, hidden]
    g, _ = head_train_hidden(head, seq[None], prev[None], torch.arange(seq.shape[0])[None])
    return head.logits(g[0])


def choose_vocab(labels: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor | None:
    """The `size` most frequent ids of `labels` (ties: the lower id), sorted; None for all."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.bincount(labels, minlength=vocab_size)
    rank = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(rank[:size]), dtype=torch.int64)


def scored_labels(data: Distilled) -> torch.Tensor:
    """The target's choices on the continuation rows (those the loss scores) [M]."""
    return torch.cat([data.labels[s + p : e] for s, e, p in data.bounds()])


def init_head(target: DecoderLM, seed: int, h_rms: float = 1.0) -> MTPHead:
    """The head's starting point (module docstring), trainable; `h_rms` the states' mean RMS."""
    head = MTPHead(target)
    head.layer.load_state_dict(target.model.layers[-1].state_dict())
    head.norm.load_state_dict(target.model.norm.state_dict())
    hidden = target.spec.hidden_size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.hnorm.weight.fill_(h_rms)
        w = torch.randn(hidden, hidden, generator=gen) * 0.02
        head.eh_proj.weight.copy_(torch.cat([w, torch.eye(hidden)], dim=1))
    head.requires_grad_(True)
    return head


def windows(data: Distilled, width: int) -> list[tuple[int, int]]:
    """(first row, rows) of every training window: `width` rows ending at each sequence's end,
    then every `width` rows back while the window still holds continuation rows."""
    out = []
    for s, e, p in data.bounds():
        end = e
        while end > s + p:
            out.append((max(s, end - width), end - max(s, end - width)))
            end -= width
    return out


def window_batch(
    data: Distilled, picked: list[tuple[int, int]], width: int, to_row: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """(tokens, prev states, positions, labels) [B, W(, hidden)] of the picked windows, padded
    at the end; label IGNORE on padding, prompt rows and rows whose choice `to_row` (a target
    id's row of the head, or IGNORE) leaves out."""
    b, hidden = len(picked), data.hidden.shape[1]
    tokens = torch.zeros(b, width, dtype=torch.int64)
    prev = torch.zeros(b, width, hidden)
    positions = torch.zeros(b, width, dtype=torch.int64)
    labels = torch.full((b, width), IGNORE, dtype=torch.int64)
    for i, (a, n) in enumerate(picked):
        seq = int(torch.searchsorted(data.starts, a, right=True)) - 1
        first = int(data.starts[seq])  # the sequence's row 0 (its entry 0 takes a zero state)
        tokens[i, :n] = data.tokens[a : a + n]
        lo = max(a - 1, first)
        prev[i, lo + 1 - a : n] = data.hidden[lo : a + n - 1]
        positions[i, :n] = torch.arange(a - first, a - first + n)
        labels[i, :n] = to_row[data.labels[a : a + n]]
        labels[i, : max(0, first + int(data.prompt_lens[seq]) - a)] = IGNORE  # prompt rows
    return tokens, prev, positions, labels


def _loss(head: MTPHead, batch: tuple[torch.Tensor, ...], depth: int) -> torch.Tensor:
    """Cross-entropy of each trained depth, summed: depth 1 over the target's states, depth 2
    over the head's own first-pass outputs (the window's entry 0 has none: not scored)."""
    tokens, prev, positions, labels = batch
    ce = nn.functional.cross_entropy
    g, kv = head_train_hidden(head, tokens, prev, positions)
    loss = ce(head_logits(head, g).flatten(0, 1), labels.flatten())
    if depth >= 2:
        own = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1).detach()  # g_{j-1}
        g2, _ = head_train_hidden(head, tokens, own, positions, (kv[0].detach(), kv[1].detach()))
        chained = labels.clone()
        chained[:, 0] = IGNORE
        loss = loss + ce(head_logits(head, g2).flatten(0, 1), chained.flatten())
    return loss


def head_logits(head: MTPHead, g: torch.Tensor) -> torch.Tensor:
    """Logits over the head's rows (its reduced vocabulary): [..., hidden] -> [..., K]."""
    return nn.functional.linear(head.norm(g), head.head_rows())


def _train(head: MTPHead, data: Distilled, cfg: TrainConfig) -> None:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(cfg.seed)
    to_row = torch.arange(head.target[0].vocab_size)
    if head.vocab_ids is not None:
        to_row = torch.full_like(to_row, IGNORE)
        to_row[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    cut, perm = windows(data, cfg.window), []
    if not cut:
        raise ValueError("nextn training: no continuation rows to learn (new_tokens = 0?)")
    for step in range(cfg.steps):
        if len(perm) < cfg.batch:
            perm += torch.randperm(len(cut), generator=order).tolist()
        picked, perm = [cut[i] for i in perm[: cfg.batch]], perm[cfg.batch :]
        batch = window_batch(data, picked, cfg.window, to_row)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        loss = _loss(head, batch, cfg.depth)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 40 == 0 or step == cfg.steps - 1:
            print(f"kvstrata: nextn step {step} loss {float(loss.detach()):.3f}", file=sys.stderr)


def distilled(
    target: DecoderLM, prompts: list[list[int]], cfg: DataConfig, cache: Path | None
) -> Distilled:
    """The distillation data, from `cache` (a file named by its key) or made now (and saved)."""
    path = None if cache is None else cache / f"{data_key(target, prompts, cfg)}.safetensors"
    if path is not None and path.is_file():
        return Distilled.load(path)
    data = distill(target, prompts, cfg)
    if path is not None:
        data.save(path)
    return data


def train_head(target: DecoderLM, data: Distilled, cfg: TrainConfig) -> MTPHead:
    """A trained head (inference only) from distillation data."""
    rms = float(data.hidden.pow(2).mean(-1).sqrt().mean())
    head = init_head(target, cfg.seed, rms)
    ids = choose_vocab(scored_labels(data), cfg.vocab, target.vocab_size)
    if ids is not None:
        head.set_vocab(ids)
    _train(head, data, cfg)
    head.requires_grad_(False)
    return head


def train_nextn(
    target: DecoderLM,
    prompts: list[list[int]],
    out: Path,
    cfg: TrainConfig = TrainConfig(),
    data_cache: Path | None = None,
) -> Path:
    """Build a NextN layer of `target` from its continuations of `prompts`; save it at `out`.
    `data_cache`: a folder where the distillation data is kept for a later build."""
    print(f"kvstrata: training a NextN draft layer at {out} (once, minutes)", file=sys.stderr)
    started, threads = time.monotonic(), torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order, so the same bytes, on every machine
    try:
        head = train_head(target, distilled(target, prompts, cfg.data, data_cache), cfg)
    finally:
        torch.set_num_threads(threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, tmp)
    os.replace(tmp, out)
    print(f"kvstrata: NextN layer at {out} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return out

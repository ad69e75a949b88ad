"""`--spec-draft nextn`: the checkpoint's NextN layer from DIR/nextn.safetensors; the trainer's
whole-sequence forward equals the paged inference path; a NextN layer trained here is the same
bytes every build (seeded) and drafts tokens the target accepts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import SeqBatch
from kvstrata.model.mtp import load_head_file
from kvstrata.model.nextn import NEXTN_FILE
from kvstrata.model.nextn_data import DataConfig, distill
from kvstrata.model.nextn_train import (
    TrainConfig,
    choose_vocab,
    head_train_hidden,
    head_train_logits,
    init_head,
    train_nextn,
    windows,
)

torch.set_num_threads(1)
CKPT = {"seed": 11, "num_hidden_layers": 3, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""
TINY_TRAIN = TrainConfig(
    data=DataConfig(new_tokens=12, batch=4), vocab=48, window=16, batch=4, steps=30, lr=3e-3
)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(5, 90, (n_tok,), generator=gen).tolist() for n_tok in range(10, 10 + n)]


def _run(model, draft: str, cache_dir: Path, prompts, model_dir: Path | None = None):  # noqa: ANN001, ANN201
    cfg = EngineConfig(
        model=str(model_dir or ""),
        spec_draft=draft,
        spec_tokens=3,
        model_cache_dir=str(cache_dir),
    )
    built = build_engine(cfg, CacheConfig(page_size=8, device_pages=64, host_pages=0), model=model)
    reqs = [Request(f"r{i}", p, max_new_tokens=16) for i, p in enumerate(prompts)]
    built.engine.run(reqs)
    built.engine.check_integrity()
    built.close()
    return reqs


@pytest.mark.parametrize("vocab", [0, 40])
def test_train_forward_equals_paged_forward(ckpt: Path, vocab: int) -> None:
    """head_train_logits (causal sdpa, autograd) = MTPHead.forward over a pool (fp32 1e-4), with
    the whole vocabulary and with a reduced one (then -inf outside vocab_ids)."""
    model = load_model(ckpt)
    head = init_head(model, seed=1)
    head.requires_grad_(False)
    seq = _prompts(1)[0] + [7, 8, 9, 10, 11, 12]
    data = distill(model, [seq], DataConfig(new_tokens=0))
    h = data.hidden
    ids = choose_vocab(torch.arange(model.vocab_size).flip(0) % 61, vocab, model.vocab_size)
    if ids is not None:
        head.set_vocab(ids)
        assert ids.tolist() == list(range(40))  # counts tie: the lower ids
    want = head_train_logits(head, torch.tensor(seq), h)
    s = model.kv_shape(8)
    pool = DevicePool(KVShape(1, s.num_kv_heads, s.head_dim, 8, s.dtype), 4)
    prev = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
    batch = SeqBatch.build([seq], [0], [[0, 1, 2, 3]])
    got, _ = head(batch, prev, pool, last_only=False)
    keep = torch.arange(model.vocab_size) if ids is None else ids
    assert float((got[:, keep] - want[:, keep]).norm() / want[:, keep].norm()) <= 1e-4
    outside = torch.ones(model.vocab_size, dtype=torch.bool)
    outside[keep] = False
    assert bool(torch.isneginf(got[:, outside]).all()) and bool(
        torch.isneginf(want[:, outside]).all()
    )
    target_pool = DevicePool(model.kv_shape(8), 4)
    assert data.labels.tolist() == model(batch, target_pool).argmax(-1).tolist()


def test_chained_train_pass_equals_chained_drafts(ckpt: Path) -> None:
    """The trainer's second pass (entry j takes the first pass's g_{j-1}, sees that pass's keys
    before j) = MTPHead.forward's 2nd draft after entries 0 .. c with the target's states: the
    entry at c + 1 taking g_c (fp32 1e-4), for every c."""
    model = load_model(ckpt)
    head = init_head(model, seed=1)
    head.requires_grad_(False)
    seq = _prompts(1)[0] + [7, 8, 9, 10, 11, 12]
    h = distill(model, [seq], DataConfig(new_tokens=0)).hidden
    prev = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
    ids, pos = torch.tensor(seq)[None], torch.arange(len(seq))[None]
    g1, kv = head_train_hidden(head, ids, prev[None], pos)
    own = torch.cat([torch.zeros_like(g1[:, :1]), g1[:, :-1]], 1)
    want = head.logits(head_train_hidden(head, ids, own, pos, kv)[0][0])  # [T, vocab]
    s = model.kv_shape(8)
    for c in range(len(seq) - 1):
        pool = DevicePool(KVShape(1, s.num_kv_heads, s.head_dim, 8, s.dtype), 4)
        first = SeqBatch.build([seq[: c + 1]], [0], [[0, 1, 2, 3]])
        _, g = head(first, prev[: c + 1], pool, last_only=False)
        chained = SeqBatch.build([[seq[c + 1]]], [c + 1], [[0, 1, 2, 3]])
        got, _ = head(chained, g[c:], pool, last_only=True)
        assert float((got[0] - want[c + 1]).norm() / want[c + 1].norm()) <= 1e-4


def test_windows_cover_the_continuation_from_the_end() -> None:
    """Windows end at each sequence's end and step back while they reach its continuation."""
    from kvstrata.model.nextn_data import Distilled

    data = Distilled(
        tokens=torch.zeros(30, dtype=torch.int64),
        hidden=torch.zeros(30, 4),
        labels=torch.zeros(30, dtype=torch.int64),
        starts=torch.tensor([0, 20, 30]),
        prompt_lens=torch.tensor([3, 8]),
    )
    # sequence 0: rows 0..19, continuation from 3: [12, 20), [4, 12), [0, 4); sequence 1:
    # rows 20..29, continuation from 28: [22, 30)
    assert windows(data, 8) == [(12, 8), (4, 8), (0, 4), (22, 8)]


def test_trained_nextn_is_reproducible_and_drafts_accepted(ckpt: Path, tmp_path: Path) -> None:
    """Two builds give the same bytes; as DIR/nextn.safetensors the layer serves --spec-draft
    nextn with greedy outputs equal plain decoding, and more drafts accepted than a random
    head of the same shape."""
    model = load_model(ckpt)
    a = train_nextn(model, _prompts(6), tmp_path / "a.safetensors", TINY_TRAIN)
    b = train_nextn(model, _prompts(6), tmp_path / "b.safetensors", TINY_TRAIN)
    assert a.read_bytes() == b.read_bytes()
    head = load_head_file(a, model, "nextn")
    assert head.vocab_ids is not None and len(head.vocab_ids) == 48  # the reduced head is kept
    model_dir = tmp_path / "model"
    shutil.copytree(ckpt, model_dir)
    shutil.copy(a, model_dir / NEXTN_FILE)
    prompts = _prompts(4)
    plain = _run(model, "", tmp_path, prompts)
    nextn = _run(model, "nextn", tmp_path, prompts, model_dir)
    rand = _run(model, "mtp:random", tmp_path, prompts)
    assert [r.output for r in nextn] == [r.output for r in plain]
    assert sum(sum(r.spec_accepts) for r in nextn) > sum(sum(r.spec_accepts) for r in rand)


def test_nextn_without_a_layer_is_refused(ckpt: Path, tmp_path: Path) -> None:
    model = load_model(ckpt)
    cfg = EngineConfig(model=str(ckpt), spec_draft="nextn", model_cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no nextn.safetensors beside the model"):
        build_engine(cfg, CacheConfig(page_size=8, device_pages=64, host_pages=0), model=model)

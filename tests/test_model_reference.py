"""Our paged decoder against transformers' own forward on tiny random checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.memory.pool import DevicePool
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM, SeqBatch
from tests.tiny_models import (
    LLAMA3_SCALING,
    hf_greedy,
    hf_logits,
    load_hf,
    make_llama,
    make_qwen2,
    rel_err,
)

torch.set_num_threads(1)
PAGE = 4  # small pages so every test crosses page boundaries
TOL = 1e-4

VARIANTS: dict[str, Callable[[Path], Path]] = {
    # untied head, llama3 rope scaling, GQA (4 query heads over 2 K/V heads)
    "llama-llama3": lambda p: make_llama(p, seed=1, rope_scaling=LLAMA3_SCALING),
    # tied embeddings, linear rope scaling, MQA, attention + MLP biases
    "llama-tied-linear-bias": lambda p: make_llama(
        p,
        seed=2,
        tie=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        num_key_value_heads=1,
        attention_bias=True,
        mlp_bias=True,
    ),
    # Qwen2: q/k/v biases, tied embeddings
    "qwen2": lambda p: make_qwen2(p, seed=3),
    # YaRN: scaled frequencies and cos/sin scaled by its attention factor
    "llama-yarn": lambda p: make_llama(
        p,
        seed=7,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[DecoderLM, Any]:
    path = VARIANTS[request.param](tmp_path_factory.mktemp(request.param))
    return load_model(path), load_hf(path)


def tokens(n: int, seed: int, vocab: int = 97) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def new_pool(model: DecoderLM, capacity: int = 48) -> DevicePool:
    return DevicePool(model.kv_shape(PAGE), capacity)


def pages(pool: DevicePool, n_tokens: int) -> torch.Tensor:
    """Allocate pages for n_tokens, handed out in reverse so logical != physical order."""
    ids = pool.allocator.alloc(-(-n_tokens // PAGE))
    assert ids is not None
    return torch.tensor(ids[::-1])


def run_chunks(
    model: DecoderLM, pool: DevicePool, toks: list[int], chunks: list[int]
) -> torch.Tensor:
    """Prefill `toks` in several forwards, each continuing the cached context in `pool`."""
    table, out, done = pages(pool, len(toks)), [], 0
    for n in chunks:
        batch = SeqBatch.build([toks[done : done + n]], [done], [table])
        out.append(model(batch, pool))
        done += n
    assert done == len(toks)
    return torch.cat(out)


def test_prefill_one_shot_matches_hf(models: tuple[DecoderLM, Any]) -> None:
    ours, hf = models
    toks = tokens(23, seed=5)
    logits = run_chunks(ours, new_pool(ours), toks, [23])
    ref = hf_logits(hf, toks)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape == (23, 97)
    assert rel_err(logits, ref) <= TOL
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_chunked_prefill_equals_one_shot(models: tuple[DecoderLM, Any]) -> None:
    ours, hf = models
    toks = tokens(23, seed=6)
    one_shot = run_chunks(ours, new_pool(ours), toks, [23])
    chunked = run_chunks(ours, new_pool(ours), toks, [5, 1, 9, 8])
    assert rel_err(chunked, one_shot) <= TOL
    assert rel_err(chunked, hf_logits(hf, toks)) <= TOL


def test_batch_of_three_equals_each_alone(models: tuple[DecoderLM, Any]) -> None:
    """A varlen batch mixing a decode step, a fresh prefill and a continued chunk."""
    ours, _ = models
    a, b, c = tokens(10, seed=7), tokens(12, seed=8), tokens(9, seed=9)
    pool = new_pool(ours)
    ta, tb, tc = pages(pool, 10), pages(pool, 12), pages(pool, 9)
    ours(SeqBatch.build([a[:9], c[:4]], [0, 0], [ta, tc]), pool)  # cache a[:9] and c[:4]
    mixed = ours(SeqBatch.build([a[9:], b, c[4:]], [9, 0, 4], [ta, tb, tc]), pool)
    assert mixed.shape == (1 + 12 + 5, 97)
    alone = [run_chunks(ours, new_pool(ours), s, [len(s)]) for s in (a, b, c)]
    assert rel_err(mixed[:1], alone[0][9:]) <= TOL
    assert rel_err(mixed[1:13], alone[1]) <= TOL
    assert rel_err(mixed[13:], alone[2][4:]) <= TOL


def test_greedy_decode_matches_hf(models: tuple[DecoderLM, Any]) -> None:
    ours, hf = models
    prompt = tokens(10, seed=10)
    pool = new_pool(ours)
    table = pages(pool, len(prompt) + 8)
    last = ours(SeqBatch.build([prompt], [0], [table]), pool, last_only=True)  # [1, vocab]
    generated: list[int] = []
    for _ in range(8):
        generated.append(int(last[0].argmax()))
        ctx = len(prompt) + len(generated) - 1
        last = ours(SeqBatch.build([generated[-1:]], [ctx], [table]), pool, last_only=True)
    assert generated == hf_greedy(hf, prompt, 8)


def test_last_only_returns_each_sequences_last_row(models: tuple[DecoderLM, Any]) -> None:
    ours, _ = models
    a, b = tokens(6, seed=11), tokens(3, seed=12)
    pool = new_pool(ours)
    batch = SeqBatch.build([a, b], [0, 0], [pages(pool, 6), pages(pool, 3)])
    full = ours(batch, pool)
    last = ours(batch, pool, last_only=True)  # rewriting the same K/V is idempotent
    assert last.shape == (2, 97)
    assert torch.allclose(last, full[[5, 8]], rtol=0, atol=1e-6)


def test_last_only_runs_the_last_layer_on_the_last_rows_alone(
    models: tuple[DecoderLM, Any],
) -> None:
    """A mixed batch (decode, fresh prefill, continued chunk) with last_only: the last layer's
    MLP sees one row per sequence, its logits equal the full forward's last rows, and every
    row's K/V of every layer is cached exactly as a full forward caches it."""
    ours, _ = models
    a, b, c = tokens(10, seed=14), tokens(12, seed=15), tokens(9, seed=16)
    seen: list[tuple[int, ...]] = []
    hook = ours.model.layers[-1].mlp.register_forward_hook(
        lambda _m, args, _o: seen.append(tuple(args[0].shape))
    )
    try:
        out, data = [], []
        for last_only in (False, True):
            pool = new_pool(ours)
            ta, tb, tc = pages(pool, 10), pages(pool, 12), pages(pool, 9)
            ours(SeqBatch.build([a[:9], c[:4]], [0, 0], [ta, tc]), pool)
            batch = SeqBatch.build([a[9:], b, c[4:]], [9, 0, 4], [ta, tb, tc])
            out.append(ours(batch, pool, last_only=last_only))
            data.append(pool.data.clone())
            pool.check_integrity()
    finally:
        hook.remove()
    hidden = ours.spec.hidden_size
    assert seen == [(13, hidden), (18, hidden), (13, hidden), (3, hidden)]
    assert rel_err(out[1], out[0][[0, 12, 17]]) <= TOL
    assert torch.allclose(data[1], data[0], rtol=0, atol=1e-6)


def test_before_layer_runs_before_the_layer_touches_the_pool(
    models: tuple[DecoderLM, Any],
) -> None:
    ours, _ = models
    pool = new_pool(ours)
    table = pages(pool, 7)
    seen: list[tuple[int, bool, bool]] = []

    def hook(layer: int) -> None:
        layer_written = bool(pool.k(layer).abs().sum() > 0)
        prev_written = layer == 0 or bool(pool.k(layer - 1).abs().sum() > 0)
        seen.append((layer, layer_written, prev_written))

    ours(SeqBatch.build([tokens(7, seed=13)], [0], [table]), pool, before_layer=hook)
    assert seen == [(layer, False, True) for layer in range(ours.spec.num_layers)]
    untouched = sorted(set(range(pool.capacity)) - set(table.tolist()))
    assert float(pool.data[:, :, untouched].abs().sum()) == 0.0  # only its own pages written
    pool.check_integrity()


def test_every_attention_route_matches_hf(tmp_path: Path) -> None:
    """Long first chunk (causal), a continuing chunk split by log-sum-exp and its masked
    variant, decode, and positions that are not the last tokens (general mask): all = HF."""
    from kvstrata.model.attention import route
    from kvstrata.model.attn_meta import build_meta

    path = make_llama(tmp_path / "long", seed=7, max_position_embeddings=1024)
    ours, hf = load_model(path), load_hf(path)
    assert ours.spec.num_kv_heads < ours.spec.num_heads  # grouped K/V heads, never repeated
    n = 600
    toks = tokens(n, seed=8)
    ref = hf_logits(hf, toks)
    cap = n // PAGE + 1
    outs = []
    for dense in (True, False):  # CPU fp32 chunks by oneDNN matmuls, then the kernels above
        for layer in ours.model.layers:
            layer.self_attn.dense_prefill, layer.self_attn.split_prefix = dense, True
        one_shot = run_chunks(ours, new_pool(ours, capacity=cap), toks, [n])
        chunked = run_chunks(ours, new_pool(ours, capacity=cap), toks, [250, 349, 1])
        for layer in ours.model.layers:
            layer.self_attn.split_prefix = False
        masked = run_chunks(ours, new_pool(ours, capacity=cap), toks, [250, 350])
        outs += [one_shot, chunked, masked]
    for layer in ours.model.layers:
        layer.self_attn.dense_prefill, layer.self_attn.split_prefix = True, True
    for out in outs:
        assert rel_err(out, ref) <= TOL
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # which route each of those forwards took
    pos = lambda a, b: torch.arange(a, b)  # noqa: E731
    tables = [torch.arange(cap)]
    ways = [
        route(build_meta(pos(a, b), [b - a], [b], tables, PAGE), 0, split)
        for a, b, split in ((0, n, True), (250, 599, True), (599, 600, True), (250, 600, False))
    ]
    assert ways == ["first_chunk", "split_prefix", "decode", "masked_prefix"]
    # the general route: positions 3, 70, 599 recomputed over a context already in the pool
    pool = new_pool(ours, capacity=cap)
    table = pages(pool, n)
    ours(SeqBatch.build([toks], [0], [table]), pool)
    picks = [3, 70, 599]
    batch = SeqBatch.build([[toks[p] for p in picks]], [0], [table])
    batch.positions, batch.ctx_lens = torch.tensor(picks), [n]
    meta = build_meta(batch.positions, batch.seq_lens, batch.ctx_lens, [table], PAGE)
    assert route(meta, 0, True) == "general"
    assert rel_err(ours(batch, pool), ref[picks]) <= TOL


@pytest.mark.parametrize("dense", [True, False])
def test_chunks_over_one_run_of_pages_match_hf(models: tuple[DecoderLM, Any], dense: bool) -> None:
    """Pages at consecutive ids (the engine's usual table): the prefix is read in place as one
    slice of the pool, by the dense route and by the split-prefix kernels alike."""
    from kvstrata.model import dense_attention

    ours, hf = models
    toks = tokens(41, seed=17)
    if dense:  # the route runs here (CPU fp32, one thread), not silently the kernels above
        assert dense_attention.usable(torch.zeros(1, 1, 1), 41)
    pool = new_pool(ours)
    table = torch.arange(3, 3 + -(-41 // PAGE))
    for layer in ours.model.layers:
        layer.self_attn.dense_prefill = dense
    try:
        out, done = [], 0
        for n in (9, 20, 12):
            out.append(ours(SeqBatch.build([toks[done : done + n]], [done], [table]), pool))
            done += n
    finally:
        for layer in ours.model.layers:
            layer.self_attn.dense_prefill = True
    assert rel_err(torch.cat(out), hf_logits(hf, toks)) <= TOL


def test_prefix_gathered_in_blocks_matches_hf(
    models: tuple[DecoderLM, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A continuing chunk whose prefix spans several gather blocks (10 tokens: 2 pages of 4,
    one partial block at the end) merges every block by log-sum-exp: = HF."""
    import kvstrata.model.attention as attention

    monkeypatch.setattr(attention, "PREFIX_BLOCK_TOKENS", 10)
    ours, hf = models
    toks = tokens(41, seed=9)
    for layer in ours.model.layers:  # the split-prefix kernels (CPU fp32 runs dense_attention)
        layer.self_attn.dense_prefill = False
    try:
        chunked = run_chunks(ours, new_pool(ours), toks, [7, 22, 12])  # prefixes 7 and 29
    finally:
        for layer in ours.model.layers:
            layer.self_attn.dense_prefill = True
    assert rel_err(chunked, hf_logits(hf, toks)) <= TOL

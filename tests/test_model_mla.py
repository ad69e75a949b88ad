"""The DeepSeek-V3 (MLA + MoE) decoder over latent pages against transformers' own forward, and
its pages through the cache tiers: cold, chunked, batched decode, absorbed = plain,
device/host/storage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from kvstrata.cache.keys import KEY_LAYOUT_VERSION, Namespace
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM, SeqBatch
from kvstrata.model.deepseek import MLADecoderLM
from kvstrata.model.mla_attention import MLAttention
from kvstrata.storage.units import PagePart, UnitLayout
from tests.test_engine_cache import conversation, turns_from_every_tier
from tests.tiny_models import YARN_SCALING, hf_greedy, hf_logits, load_hf, rel_err

torch.set_num_threads(1)
PAGE = 4  # small pages so every test crosses page boundaries
TOL = 1e-4

MLA_CKPT = {"seed": 1, "rope_scaling": YARN_SCALING}
"""This module's tiny DeepseekV3: YaRN rope, query LoRA, interleaved rope, 1 dense + 2 MoE."""

VARIANTS: dict[str, dict[str, Any]] = {
    "yarn-qlora-interleave": MLA_CKPT,
    # no query LoRA (q_proj), rope not interleaved, plain rope, attention biases
    "qproj-rotate-half": {
        "seed": 2,
        "q_lora_rank": None,
        "rope_interleave": False,
        "attention_bias": True,
    },
}


@pytest.fixture(scope="module")
def model(mla_ckpt: Path) -> DecoderLM:
    return load_model(mla_ckpt)


@pytest.fixture(scope="module")
def hf(mla_ckpt: Path) -> Any:
    return load_hf(mla_ckpt)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


def pages(pool: DevicePool, n_tokens: int) -> torch.Tensor:
    """Pages for n_tokens, handed out in reverse so logical != physical order."""
    ids = pool.allocator.alloc(-(-n_tokens // PAGE))
    assert ids is not None
    return torch.tensor(ids[::-1])


def run_chunks(model: DecoderLM, toks: list[int], chunks: list[int]) -> torch.Tensor:
    """Prefill `toks` in several forwards, each continuing the cached latents in a new pool."""
    pool = DevicePool(model.kv_shape(PAGE), 32)
    table, out, done = pages(pool, len(toks)), [], 0
    for n in chunks:
        out.append(model(SeqBatch.build([toks[done : done + n]], [done], [table]), pool))
        done += n
    pool.check_integrity()
    return torch.cat(out)


def set_absorb(model: DecoderLM, absorb: bool | None) -> None:
    for layer in model.model.layers:
        assert isinstance(layer.self_attn, MLAttention)
        layer.self_attn.absorb = absorb


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cold_logits_equal_transformers(variant: str, tiny_checkpoints: Any) -> None:
    path = tiny_checkpoints.deepseek(**VARIANTS[variant])
    model, hf = load_model(path), load_hf(path)
    assert isinstance(model, MLADecoderLM)
    rope = hf.model.rotary_emb
    assert torch.equal(model.rotary.inv_freq, rope.inv_freq)  # YaRN's frequencies, exactly
    assert model.rotary.attention_factor == pytest.approx(rope.attention_scaling, rel=1e-12)
    toks = tokens(90, seed=3)  # positions well past YaRN's original 32
    assert rel_err(run_chunks(model, toks, [90]), hf_logits(hf, toks)) <= TOL


def test_latent_page_shape(model: DecoderLM) -> None:
    """One row [kv_lora_rank + qk_rope_head_dim] per token per layer, no K/V heads."""
    shape = model.kv_shape(PAGE)
    assert shape == KVShape(3, 1, (16 + 8) // 2, PAGE, "float32", "mla")
    assert shape.latent_row == 24 and shape.page_numel == 3 * PAGE * 24
    assert DevicePool(shape, 4).k(0).shape == (4, PAGE, 1, 12)


def test_chunked_prefill_equals_transformers(model: DecoderLM, hf: Any) -> None:
    toks = tokens(29, seed=4)
    ref = hf_logits(hf, toks)
    for chunks in ([29], [5, 7, 17], [1, 1, 3, 24], [4, 4, 4, 17]):  # page-aligned and not
        assert rel_err(run_chunks(model, toks, chunks), ref) <= TOL, chunks


def test_batched_decode_equals_transformers(model: DecoderLM, hf: Any) -> None:
    prompts = [tokens(n, seed=10 + n) for n in (6, 11, 3)]
    steps = 4
    want = [hf_greedy(hf, p, steps) for p in prompts]
    pool = DevicePool(model.kv_shape(PAGE), 32)
    tables = [pages(pool, len(p) + steps) for p in prompts]
    logits = model(SeqBatch.build(prompts, [0, 0, 0], tables), pool, last_only=True)
    seqs = [list(p) for p in prompts]
    for step in range(steps):
        nxt = logits.argmax(-1).tolist()
        for s, seq in enumerate(seqs):
            assert nxt[s] == want[s][step]
            ref = hf_logits(hf, seq)[-1]
            assert rel_err(logits[s], ref) <= TOL
            seq.append(nxt[s])
        batch = SeqBatch.build([[t] for t in nxt], [len(q) - 1 for q in seqs], tables)
        logits = model(batch, pool)  # one token each: attention in latent space (absorbed)
    pool.check_integrity()


def test_absorbed_equals_plain(model: DecoderLM) -> None:
    """Attention in latent space (W_UK folded into the query, W_UV after) is the plain one."""
    toks = tokens(27, seed=6)
    out = {}
    for absorb in (False, True):
        set_absorb(model, absorb)
        out[absorb] = run_chunks(model, toks, [9, 1, 17])
    set_absorb(model, None)
    assert rel_err(out[True], out[False]) <= 1e-5
    # by default the cheaper one: latent space below 16 * 22 / (24 + 16 - 20 - 10) = 35.2 queries
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, MLAttention)
    assert attn.absorbs(1) and attn.absorbs(35) and not attn.absorbs(36)


def test_prefix_hits_from_every_tier_equal_cold(model: DecoderLM, tmp_path: Path) -> None:
    prompts = conversation(3, seed=2)
    storage = turns_from_every_tier(model, tmp_path, prompts, stored_turns=1, chunk=16)
    assert storage[0].hits == {"device": 0, "host": 0, "storage": (len(prompts[0]) - 1) // 8}


def test_latent_namespace_and_units() -> None:
    """Latent pages get their own namespace (never a GQA page's key, same model or not) and
    storage units cut by layer range only."""
    gqa = Namespace("fp", "float32", page_size=PAGE)
    mla = Namespace("fp", "float32", page_size=PAGE, kv_layout="mla")
    assert gqa.seed() != mla.seed()
    blob = json.dumps(["fp", "float32", KEY_LAYOUT_VERSION, "", PAGE]).encode()
    assert gqa.seed() == xxhash.xxh3_128_intdigest(blob)  # GQA keys are what they always were
    shape = KVShape.latent(3, 24, PAGE)
    layout = UnitLayout(shape)
    part = PagePart(shape, (0, 3), (0, 1))
    assert layout.blocks(part) == [((n, n + 1), (0, 1)) for n in range(3)]
    assert layout.unit_nbytes == PAGE * 24 * 4  # one layer's latent rows of a page
    assert part.shape == shape and PagePart(shape, (1, 3), (0, 1)).shape.layout == "mla"
    with pytest.raises(ValueError, match="even"):
        KVShape.latent(3, 23, PAGE)


def test_nextn_layer_weights_are_not_the_targets(mla_ckpt: Path, tmp_path: Path) -> None:
    """A checkpoint's NextN/MTP layers (model.layers.N.* past num_hidden_layers) are left to a
    draft: the target loads without them and computes the same logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(mla_ckpt, tmp_path / "nextn")
    (file,) = (tmp_path / "nextn").glob("*.safetensors")
    state = load_file(str(file))
    state["model.layers.3.eh_proj.weight"] = torch.ones(64, 128)
    state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.ones(88, 16)
    save_file(state, str(file), metadata={"format": "pt"})
    toks = tokens(13, seed=8)
    with_nextn = run_chunks(load_model(tmp_path / "nextn"), toks, [13])
    assert torch.equal(with_nextn, run_chunks(load_model(mla_ckpt), toks, [13]))

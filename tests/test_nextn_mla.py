"""`--spec-draft nextn` on a DeepSeek-V3-shaped (MLA + MoE) checkpoint: the draft is the
checkpoint's own NextN layer (`model.layers.{num_hidden_layers}.*`), its state part of every
latent page.

- the draft's paged forward, chunk by chunk over a latent pool, equals a from-scratch
  whole-sequence computation of the same layer by transformers' own DeepseekV3DecoderLayer fed
  with transformers' final (normed) hidden states (fp32, rel <= 1e-4);
- greedy outputs with the draft equal those without;
- acceptance after a restore from device (L1), host (L2, forced demotion) and storage (L3, a
  fresh engine) equals a cold run's, request by request;
- a page stored without its draft state (an older store: target + NextN KV, no state layers),
  or by an engine without the draft, is a miss.
The tiny checkpoint's NextN layer is a bigram predictor with its own output head
(tests.tiny_models._add_nextn_layer), so some drafts are accepted and acceptance checks bite."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from kvstrata.engine.config import EngineConfig
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import SeqBatch
from kvstrata.model.deepseek_nextn import DeepSeekNextN
from kvstrata.model.moe import MoE
from kvstrata.model.nextn import load_nextn
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.spec import check_spec_layout
from kvstrata.storage.units import PagePart, open_unit_storage
from tests.test_speculative_restore import PAGE, assert_same_acceptance, conversation, run_turns
from tests.tiny_models import load_hf, rel_err

torch.set_num_threads(1)
LAYERS = 3  # the tiny DeepSeek's decoder layers; its NextN layer is model.layers.3.*
MLA_CKPT = {"seed": 3, "num_nextn_predict_layers": 1}
"""This module's tiny DeepseekV3 with one NextN layer (the `mla_ckpt` fixture)."""


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def reference_logits(ckpt: Path, tmp: Path, tokens: list[int]) -> torch.Tensor:
    """[T, vocab] draft logits from scratch: entry j = NextN(t_j, final hidden state h_{j-1}
    of transformers' forward) through transformers' decoder layer built from the checkpoint's
    NextN weights (a copy of the checkpoint one layer deeper). Entries 1 .. T-1 are DeepSeek's
    MTP sequence, run as one causal sequence; entry 0 (a zero state) runs alone."""
    deeper = tmp / "deeper"
    deeper.mkdir()
    cfg = json.loads((ckpt / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": LAYERS + 1}))
    (deeper / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    hf, hf_deep = load_hf(ckpt), load_hf(deeper)
    ids = torch.tensor([tokens])
    h = hf.model(ids).last_hidden_state[0]  # [T, hidden] after the final norm
    prev = torch.cat([torch.zeros_like(h[:1]), h[:-1]])  # entry j reads h_{j-1}
    from safetensors.torch import load_file

    w = {
        k[len(f"model.layers.{LAYERS}.") :]: v
        for k, v in load_file(str(ckpt / "model.safetensors")).items()
        if k.startswith(f"model.layers.{LAYERS}.")
    }
    eps = cfg["rms_norm_eps"]
    emb = w["embed_tokens.weight"][ids[0]]
    x = torch.cat([_rms(emb, w["enorm.weight"], eps), _rms(prev, w["hnorm.weight"], eps)], -1)
    x = (x @ w["eh_proj.weight"].T)[None]  # [1, T, hidden]
    pos = torch.arange(len(tokens))[None]
    rope = hf_deep.model.rotary_emb(x, pos)
    layer, gs = hf_deep.model.layers[LAYERS], []
    for part in (slice(0, 1), slice(1, len(tokens))):
        n = part.stop - part.start
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        cos_sin = tuple(r[:, part] for r in rope)
        g = layer(
            x[:, part], attention_mask=mask, position_ids=pos[:, part], position_embeddings=cos_sin
        )
        gs.append((g[0] if isinstance(g, tuple) else g)[0])
    g = torch.cat(gs)  # [T, hidden]
    return _rms(g, w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T


@torch.no_grad()
def paged_logits(model, head, tokens: list[int], chunks: list[int]) -> torch.Tensor:  # noqa: ANN001
    """[T, vocab] the head's logits, entries run chunk by chunk over a latent pool of its one
    layer, each entry fed the engine target's (pre-norm) state at the previous position."""
    n_pages = len(tokens) // PAGE + 1
    states: list[torch.Tensor] = []
    target_pool = DevicePool(model.kv_shape(PAGE), n_pages)
    model(SeqBatch.build([tokens], [0], [list(range(n_pages))]), target_pool, hidden_out=states)
    prev = torch.cat([torch.zeros_like(states[0][:1]), states[0][:-1]])
    shape = dataclasses.replace(model.kv_shape(PAGE), num_layers=1)
    assert shape.layout == "mla"
    pool, out, start = DevicePool(shape, n_pages), [], 0
    for n in chunks:
        batch = SeqBatch.build([tokens[start : start + n]], [start], [list(range(n_pages))])
        logits, _ = head(batch, prev[start : start + n], pool, last_only=False)
        out.append(logits)
        start += n
    assert start == len(tokens)
    return torch.cat(out)


def test_paged_nextn_equals_reference(mla_ckpt: Path, tmp_path: Path) -> None:
    model = load_model(mla_ckpt)
    head = load_nextn(model, mla_ckpt, tmp_path / "cache")
    assert isinstance(head, DeepSeekNextN) and isinstance(head.layer.mlp, MoE)
    assert head.embed_tokens is None  # an equal copy of the target's: shared
    assert head.head is not None  # the tiny layer's own output head differs: kept
    rng = random.Random(11)
    tokens = [rng.randrange(97) for _ in range(29)]
    ref = reference_logits(mla_ckpt, tmp_path, tokens)
    for chunks in ([29], [5, 7, 17], [1, 8, 20]):
        got = paged_logits(model, head, tokens, chunks)
        assert rel_err(got, ref) <= 1e-4, chunks


def _stale_store(model, cached: dict, root: Path) -> None:  # noqa: ANN001
    """An older version's store of the same page keys: target + NextN KV, no state layers."""
    s = model.kv_shape(PAGE)
    old = KVShape.latent(LAYERS + 1, 2 * s.head_dim, PAGE, s.dtype)
    part = PagePart(old, (0, old.num_layers), (0, 1))
    store = open_unit_storage(f"file://{root}", part)
    pages = [v[: old.num_layers].contiguous().view(torch.uint8).numpy() for v in cached.values()]
    assert store.put(list(cached), pages) == len(cached)
    store.close()


def assert_pages_restored(results) -> int:  # noqa: ANN001
    """Every restored page (target KV, NextN KV and target state) equals the bytes of the run
    that computed it; the draft's layers hold data. Returns the count."""
    computed = {k: v for r in results for k, v in r[4].items()}
    n = 0
    for _out, _acc, hits, restored, _cached in results:
        assert len(restored) == sum(hits.values())
        for key, data in restored.items():
            assert torch.equal(data, computed[key])
            assert bool(data[LAYERS:].abs().sum() > 0)
            n += 1
    return n


def assert_pages_as_fresh(model, ckpt: str, prompt: list[int], got: dict, tmp: Path) -> None:  # noqa: ANN001
    """The pages of a run that restored earlier turns (`got`: key -> page) equal, within fp32
    tolerance, those of a fresh engine computing the whole prompt: the NextN entry after each
    hit boundary read the real target state kept in the page before it."""
    fresh = run_turns(model, "device", tmp / "fresh", [prompt], tmp, False, "nextn", ckpt)[0][4]
    common = sorted(set(fresh) & set(got))
    assert len(common) >= 3
    for key in common:
        torch.testing.assert_close(got[key], fresh[key], rtol=1e-4, atol=1e-5)


def test_nextn_draft_restores_exactly_and_misses_without_state(
    mla_ckpt: Path, tmp_path: Path
) -> None:
    model = load_model(mla_ckpt)
    ckpt, cache = str(mla_ckpt), tmp_path / "cache"
    prompts = conversation(3, seed=2)

    def turns(tiers: str, store: str, draft: str = "nextn", demote: bool = False):  # noqa: ANN202
        return run_turns(
            model, tiers, tmp_path / store, prompts, cache, demote, draft, model_dir=ckpt
        )

    cold = turns("none", "unused")
    plain = turns("none", "unused", draft="")
    assert [r[0] for r in cold] == [r[0] for r in plain]  # the target decides every token
    assert sum(sum(r[1]) for r in cold) > 0  # some drafts accepted
    first_pages = (len(prompts[0]) - 1) // PAGE
    device = turns("device", "s1")
    assert all(r[2]["device"] for r in device[1:])
    assert_same_acceptance(cold, device)
    assert assert_pages_restored(device) >= 6
    assert_pages_as_fresh(model, ckpt, prompts[-1], device[-1][4], cache)
    host = turns("device_host", "s2", demote=True)
    assert [r[2]["device"] for r in host] == [0] * 3 and all(r[2]["host"] for r in host[1:])
    assert_same_acceptance(cold, host)
    assert assert_pages_restored(host) >= 6
    assert_pages_as_fresh(model, ckpt, prompts[-1], host[-1][4], cache)
    stored = turns("device_host_storage", "s3")
    again = turns("device_host_storage", "s3")  # a fresh engine: L1/L2 empty
    assert again[0][2] == {"device": 0, "host": 0, "storage": first_pages}
    assert_same_acceptance(cold, again)
    assert assert_pages_restored(stored + again) >= 6
    # pages without the draft's state: an older layout's store, or a plain engine's
    _stale_store(model, stored[0][4], tmp_path / "old")
    stale = turns("device_host_storage", "old")
    assert stale[0][2] == {"device": 0, "host": 0, "storage": 0}
    assert_same_acceptance(cold, stale)
    turns("device_host_storage", "plain", draft="")
    after_plain = turns("device_host_storage", "plain")
    assert after_plain[0][2] == {"device": 0, "host": 0, "storage": 0}
    assert_same_acceptance(cold, after_plain)


def test_missing_or_wrong_nextn_weights_are_refused(mla_ckpt: Path, tmp_path: Path) -> None:
    """A checkpoint declaring a NextN layer must hold all of it, in the target's shapes."""
    from safetensors.torch import load_file, save_file

    model = load_model(mla_ckpt)
    state = load_file(str(mla_ckpt / "model.safetensors"))
    nextn = f"model.layers.{LAYERS}."
    cases = {
        "holds no model.layers.3": {k: v for k, v in state.items() if not k.startswith(nextn)},
        "missing \\['eh_proj.weight'\\]": {
            k: v for k, v in state.items() if k != f"{nextn}eh_proj.weight"
        },
    }
    for i, (error, weights) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        (bad / "config.json").write_bytes((mla_ckpt / "config.json").read_bytes())
        save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=error):
            load_nextn(model, bad, tmp_path / "cache")


def test_tp_takes_a_head_over_latent_pages_only(mla_ckpt: Path) -> None:
    dist = DistConfig(tp=2)
    check_spec_layout(EngineConfig(model=str(mla_ckpt), spec_draft="nextn"), dist)
    with pytest.raises(ValueError, match="not supported with --tp > 1"):
        check_spec_layout(EngineConfig(spec_draft="mtp:random"), dist)  # SmolLM2: GQA pages

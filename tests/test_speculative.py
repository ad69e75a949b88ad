"""Speculative decoding, greedy: outputs equal plain greedy decoding for every draft kind and N;
a draft equal to the target accepts everything; rejected tokens leave pools and tree intact."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.model.mtp import load_head, save_head
from tests.tiny_models import make_llama, make_qwen2

torch.set_num_threads(1)
PAGE = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    return {
        "llama": make_llama(root / "llama", seed=3, num_hidden_layers=4),
        "qwen2": make_qwen2(root / "qwen2", seed=4, num_hidden_layers=3),
        "other": make_llama(root / "other", seed=8, num_hidden_layers=1),
    }


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 97) for _ in range(rng.randrange(12, 60))] for _ in range(n)]


def generate(
    model,
    cache_dir: Path,
    draft: str,
    n: int,
    ps,
    new: int = 24,
    tiers: str = "device",
    check: bool = False,
    device_pages: int = 128,
):  # noqa: ANN001, ANN201
    built = build_engine(
        EngineConfig(
            spec_draft=draft,
            spec_tokens=n,
            model_cache_dir=str(cache_dir),
            chunk_tokens=16,
            max_batch_tokens=48,
            max_running=3,
        ),
        CacheConfig(page_size=PAGE, device_pages=device_pages, host_pages=0).with_tiers(tiers),
        model=model,
    )
    reqs = [Request(f"r{i}", p, max_new_tokens=new) for i, p in enumerate(ps)]
    for r in reqs:
        built.engine.submit(r)
    while built.engine.has_work():
        built.engine.step()
        if check:
            built.engine.check_integrity()
    built.engine.check_integrity()
    built.close()
    return reqs


@pytest.mark.parametrize(
    "arch,draft", [("llama", "self:2"), ("llama", "self:1"), ("qwen2", "self:1")]
)
def test_greedy_equal_with_self_draft(ckpts, tmp_path: Path, arch: str, draft: str) -> None:  # noqa: ANN001
    model = load_model(ckpts[arch])
    ps = prompts(5, seed=len(arch))
    ref = generate(model, tmp_path, "", 1, ps, tiers="none")
    for n in (1, 3, 6):
        spec = generate(model, tmp_path, draft, n, ps)
        assert [r.output for r in spec] == [r.output for r in ref]
        for r in spec:
            assert r.spec_proposed > 0 and len(r.spec_accepts) > 0
            assert all(0 <= a <= n for a in r.spec_accepts)
            # every token but the prefill's first comes from a verify step or a last plain one
            emitted = sum(a + 1 for a in r.spec_accepts)
            assert emitted in (r.max_new_tokens - 1, r.max_new_tokens - 2)


def test_draft_checkpoint_paths(ckpts, tmp_path: Path) -> None:  # noqa: ANN001
    model = load_model(ckpts["llama"])
    ps = prompts(4, seed=2)
    ref = generate(model, tmp_path, "", 1, ps, tiers="none")
    same = generate(model, tmp_path, str(ckpts["llama"]), 4, ps)  # the target itself as draft
    assert [r.output for r in same] == [r.output for r in ref]
    assert all(r.acceptance_rate == 1.0 for r in same)  # every draft equals the target's choice
    for name in ("other", "qwen2"):  # unrelated drafts: a 1-layer Llama, a Qwen2 (same vocab)
        other = generate(model, tmp_path, str(ckpts[name]), 3, ps)
        assert [r.output for r in other] == [r.output for r in ref]
        assert sum(sum(r.spec_accepts) for r in other) < sum(r.spec_proposed for r in other)


def test_self_draft_is_built_once_as_its_own_checkpoint(ckpts, tmp_path: Path) -> None:  # noqa: ANN001
    model = load_model(ckpts["llama"])
    generate(model, tmp_path, "self:3", 2, prompts(1), new=3)
    (built,) = list((tmp_path / "drafts").iterdir())
    assert built.name == f"{model.fingerprint}-self3"
    assert json.loads((built / "config.json").read_text())["num_hidden_layers"] == 3
    draft = load_model(built)
    for i in range(3):  # the target's own layers, norm and head
        a, b = draft.model.layers[i].state_dict(), model.model.layers[i].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(draft.model.norm.weight, model.model.norm.weight)
    mtime = (built / "model.safetensors").stat().st_mtime_ns
    generate(model, tmp_path, "self:3", 2, prompts(1), new=3)
    assert (built / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_bad_drafts_are_refused(ckpts, tmp_path: Path) -> None:  # noqa: ANN001
    model = load_model(ckpts["llama"])
    for draft, msg in (
        ("self:0", "self:K"),
        ("self:4", "self:K"),
        ("self:x", "self:K"),
        (str(tmp_path / "nope"), "checkpoint"),
        (str(make_llama(tmp_path / "v", vocab_size=101, num_hidden_layers=1)), "vocab"),
        (str(make_llama(tmp_path / "h", num_key_value_heads=4, num_hidden_layers=1)), "heads"),
    ):
        with pytest.raises(ValueError, match=msg):
            generate(model, tmp_path, draft, 2, prompts(1), new=2)
    with pytest.raises(ValueError, match="spec_tokens"):
        EngineConfig(spec_tokens=0)


def test_rejected_tokens_leave_pools_and_tree_intact(ckpts, tmp_path: Path) -> None:  # noqa: ANN001
    """A long speculative run under page pressure: integrity after every step, and the cache
    only ever holds pages whose every token is final (outputs still equal plain decoding)."""
    model = load_model(ckpts["llama"])
    ps = prompts(6, seed=7)
    ps += [p + [11, 12, 13] for p in ps[:3]]  # shared prefixes: hits while others decode
    ref = generate(model, tmp_path, "", 1, ps, new=60, tiers="none")
    spec = generate(model, tmp_path, "self:2", 4, ps, new=60, check=True, device_pages=48)
    assert [r.output for r in spec] == [r.output for r in ref]
    assert sum(len(r.spec_accepts) for r in spec) > 100
    assert any(a < 4 for r in spec for a in r.spec_accepts)  # rejections happened


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equal_with_mtp_head(ckpts, tmp_path: Path, arch: str) -> None:  # noqa: ANN001
    """An MTP head with fixed random weights: greedy tokens as without speculation, pools and
    tree intact after every step; a saved head loads as mtp:PATH and drafts the same tokens."""
    model = load_model(ckpts[arch])
    ps = prompts(4, seed=7)
    ref = generate(model, tmp_path, "", 1, ps, tiers="none")
    for n in (1, 3):
        spec = generate(model, tmp_path, "mtp:random", n, ps, check=True)
        assert [r.output for r in spec] == [r.output for r in ref]
        assert all(r.spec_proposed > 0 and r.draft_computed <= r.computed for r in spec)
    save_head(load_head("mtp:random", model), tmp_path / "head.safetensors")
    saved = generate(model, tmp_path, f"mtp:{tmp_path / 'head.safetensors'}", 3, ps)
    assert [r.spec_accepts for r in saved] == [r.spec_accepts for r in spec]


def test_bad_mtp_head_is_refused(ckpts, tmp_path: Path) -> None:  # noqa: ANN001
    model = load_model(ckpts["llama"])
    with pytest.raises(ValueError, match="safetensors file"):
        generate(model, tmp_path, f"mtp:{tmp_path / 'missing'}", 2, prompts(1))
    save_head(load_head("mtp:random", load_model(ckpts["qwen2"])), tmp_path / "q.safetensors")
    with pytest.raises(ValueError, match="not an MTP head of this target"):  # q/k/v biases
        load_head(f"mtp:{tmp_path / 'q.safetensors'}", model)

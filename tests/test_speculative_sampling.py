"""Speculative sampling: the rejection rule emits tokens distributed exactly as plain sampling
from the target (checked on fixed distributions and through the engine on a tiny model, over many
fixed seeds); each seed reproduces its tokens and acceptances; temperature 0 stays greedy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.engine.sampling import Sampler, SamplingParams
from kvstrata.engine.speculative import accept_sampled
from kvstrata.model.checkpoint import load_model
from tests.tiny_models import make_llama

torch.set_num_threads(1)
VOCAB = 16  # a tiny vocabulary: a few hundred draws pin each token's frequency down
PROMPT = [(5 * i + 1) % VOCAB for i in range(21)]
SEEDS, NEW = 640, 8


def assert_matches(counts: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Counts [vocab] against expected counts (a sum of per-draw probabilities): no token off by
    5 standard deviations, and Pearson's statistic within 4 sd of its mean (the number of
    tokens). Resampling a rejected draft from p instead of max(0, p - q) fails it (seen once)."""
    n = float(expected.sum())
    var = expected * (1 - expected / n)  # binomial variance of each count
    z = (counts - expected).abs() / torch.sqrt(var + 1.0)
    assert float(z.max()) < 5.0, f"{what}: z {float(z.max()):.1f} at token {int(z.argmax())}"
    k = int((expected > 0).sum())
    chi2 = float(((counts - expected) ** 2 / expected.clamp(min=1.0)).sum())
    assert chi2 < k + 4 * math.sqrt(2 * k), f"{what}: chi2 {chi2:.0f} over {k} tokens"


def test_rejection_rule_matches_target_distribution() -> None:
    """Fixed rows (the target's choice at position j does not depend on earlier tokens): the
    token emitted at position j is distributed as p_j whether accepted, resampled or bonus."""
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(3, 6, generator=gen) * 1.5  # rows p_0, p_1 (verify), p_2 (bonus)
    draft = torch.randn(2, 6, generator=gen) * 1.5  # q_0, q_1: far from p, many rejections
    params = SamplingParams(temperature=0.9, top_p=0.95)
    trials = 3000
    counts = torch.zeros(3, 6)
    seen = torch.zeros(3)
    accepted = 0
    for seed in range(trials):
        s = Sampler(SamplingParams(0.9, 0.95, seed=seed), "x")
        q = [s.probs(draft[j]) for j in range(2)]
        drafted = [s.draw(q[j]) for j in range(2)]
        a, emit = accept_sampled(drafted, q, target, s)
        assert emit[:a] == drafted[:a] and len(emit) == a + 1
        accepted += a
        for j, tok in enumerate(emit):
            counts[j, tok] += 1
            seen[j] += 1
    ref = Sampler(params, "ref")
    for j in range(3):
        assert_matches(counts[j], seen[j] * ref.probs(target[j]), f"position {j}")
    assert 0.2 * 2 * trials < accepted < 0.8 * 2 * trials  # rejections and acceptances both


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llama")
    # initializer_range 0.2: peaked distributions (4-8 likely tokens), not a random model's flat ones
    kw = {"hidden_size": 32, "vocab_size": VOCAB, "initializer_range": 0.2}
    make_llama(root / "ckpt", seed=6, num_hidden_layers=3, **kw)
    return root


@pytest.fixture(scope="module")
def model(root: Path):  # noqa: ANN201
    return load_model(root / "ckpt")


def run(model, tmp: Path, draft: str, params: list[SamplingParams], new: int = 6) -> list[Request]:  # noqa: ANN001
    cfg = EngineConfig(
        spec_draft=draft, spec_tokens=3, model_cache_dir=str(tmp),
        chunk_tokens=32, max_batch_tokens=1024, max_running=128,
    )  # fmt: skip
    built = build_engine(cfg, CacheConfig(page_size=8, device_pages=512, host_pages=0), model=model)
    reqs = [
        Request(f"r{i}", list(PROMPT), new, keep_logits=True, sampler=Sampler(p, f"r{i}"))
        for i, p in enumerate(params)
    ]
    built.engine.run(reqs)
    built.engine.check_integrity()
    built.close()
    return reqs


@pytest.mark.slow  # ~40 s on 2 busy cores: 640 requests, twice
def test_engine_speculative_sampling_matches_plain(model, tmp_path: Path) -> None:  # noqa: ANN001
    """Through the engine, SEEDS fixed seeds: at each position k >= 1 the counts of emitted tokens
    match the sum of the target's distributions given each request's own history (what plain
    sampling draws from), for speculation and, as the control, plain sampling."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(SEEDS)]
    spec = run(model, tmp_path, "self:1", params, new=NEW)
    plain = run(model, tmp_path, "", params, new=NEW)
    proposed = sum(r.spec_proposed for r in spec)
    assert 0.2 * proposed < sum(sum(r.spec_accepts) for r in spec) < 0.7 * proposed
    # the first token comes from the prefill's row with the seed's first draw: equal per seed
    assert [r.output[0] for r in spec] == [r.output[0] for r in plain]
    for name, reqs in (("spec", spec), ("plain", plain)):
        counts, expected = torch.zeros(VOCAB), torch.zeros(VOCAB)
        for k in range(1, NEW):  # every position after the first, pooled
            counts += torch.bincount(torch.tensor([r.output[k] for r in reqs]), minlength=VOCAB)
            expected += sum(r.sampler.probs(r.logits[k]) for r in reqs)  # type: ignore[union-attr]
        assert_matches(counts, expected, name)


def test_seed_reproduces_tokens_and_acceptances(model, tmp_path: Path) -> None:  # noqa: ANN001
    params = [SamplingParams(temperature=0.8, seed=s) for s in (11, 11, 12)]
    a = run(model, tmp_path, "self:1", params, new=12)
    b = run(model, tmp_path, "self:1", params[:1], new=12)
    assert a[0].output == a[1].output == b[0].output  # same seed: same tokens, batched or not
    assert a[0].spec_accepts == a[1].spec_accepts == b[0].spec_accepts
    assert a[2].output != a[0].output


def test_temperature_zero_stays_greedy(model, tmp_path: Path) -> None:  # noqa: ANN001
    params = [SamplingParams(temperature=0.0, top_p=0.5, seed=s) for s in range(4)]
    spec = run(model, tmp_path, "self:2", params, new=10)
    plain = run(model, tmp_path, "", params, new=10)
    for s, p in zip(spec, plain, strict=True):
        assert s.output == p.output == [int(torch.argmax(row)) for row in p.logits]
    assert sum(sum(r.spec_accepts) for r in spec) > 0


def test_mtp_head_samples_reproducibly(model, tmp_path: Path) -> None:  # noqa: ANN001
    """The MTP head drafts by sampling too: the same seed gives the same tokens and acceptances,
    batched or alone, and its rejections leave pools and tree intact (run() checks them)."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in (3, 3, 4)]
    a = run(model, tmp_path, "mtp:random", params, new=12)
    b = run(model, tmp_path, "mtp:random", params[:1], new=12)
    assert a[0].output == a[1].output == b[0].output and a[2].output != a[0].output
    assert a[0].spec_accepts == a[1].spec_accepts == b[0].spec_accepts
    assert sum(r.spec_proposed for r in a) > sum(sum(r.spec_accepts) for r in a) > 0

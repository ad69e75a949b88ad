"""`kvstrata bench spec`: speculative decoding of SmolLM2 with its NextN draft layer on the agent
workload, in one run: output tokens/s with and without speculation, and acceptance on a cold
cache and after restores from device, host (forced demotion after every round) and storage (a fresh
engine every round).

The sessions' turn k run together as round k; turn k's prompt extends turn k-1's, so from round 1
on each prompt's prefix is a hit from the tier under test. Goal: acceptance after every restore
equals cold to the last digit (each request's acceptance sequence too), outputs equal plain
greedy decoding.

The draft is `nextn`: a NextN layer trained here for SmolLM2 (kvstrata.model.nextn_train, built
on first use and cached). Break-even: a step costs N draft passes (r each, in target passes:
one layer + the shared 49k-token head, r = `draft_cost_ratio`) and one verify pass, and emits
1 + a tokens. `self:K` drafts cannot win on SmolLM2 (r = 0.90 at K = 26, the least K whose
acceptance is meaningful); the NextN layer's r is about 0.24 with the whole vocabulary, less
with the reduced output head the trained layer carries (`draft_head_rows`).

Speed: `tokens_per_s_*` counts every output token over the whole serving time (the prompts'
prefill included, which speculation does not change); `decode_tokens_per_s_*` counts tokens
after each request's first over the time from its first token to its finish: decoding, which
speculation speeds up (`spec_over_plain_decode`). Plain and speculative runs alternate
TIMING_PAIRS times (the machine is shared): figures are the medians, ratios the median of the
pairs' ratios. The report also carries the machine's load average.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstrata.bench.registry import BENCHES
from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine, resolve_model_path
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.workloads.agent import WorkloadSpec, build_workload

DRAFT, SPEC_TOKENS, PAGE = "nextn", 1, 64  # N = 1: at acceptance ~0.2 a 2nd draft costs more
TIMING_PAIRS = 3  # plain and speculative runs alternate; the figures are the pairs' medians
QUICK = WorkloadSpec(sessions=2, turns=3, first_lines=10, tool_lines=6, max_new_tokens=16)
FULL = WorkloadSpec(sessions=2, turns=4, first_lines=30, tool_lines=12, max_new_tokens=32)
Rounds = list[list[list[int]]]  # [turn][session] -> prompt


def _demote(eng: Engine) -> None:
    """Push every cached page out of device memory (to host memory): fill the free pages, evict,
    give them back."""
    cache = eng.cache
    assert cache is not None
    ids = cache.alloc_device(cache.tiers.device.num_free)
    cache.tiers.evict_device(cache.tiers.device.capacity)
    cache.drain()
    cache.free_device(ids or [])


class _Runner:
    """Builds engines over one model, cache dir and store; serves rounds; keeps wall time."""

    def __init__(
        self,
        model: DecoderLM,
        rounds: Rounds,
        max_new: int,
        tmp: Path,
        cache_dir: str,
        model_dir: str = "",
    ) -> None:
        self.model, self.rounds, self.max_new, self.cache_dir = model, rounds, max_new, cache_dir
        self.model_dir = model_dir
        self.head_rows: int | None = None
        longest = max(len(p) for r in rounds for p in r) + max_new
        pages = len(rounds[0]) * (-(-longest // PAGE)) + 8
        self.cache = CacheConfig(
            page_size=PAGE,
            device_pages=pages,
            host_pages=2 * pages,
            storage_url=f"file://{tmp / 'store'}",
            prefetch_policy="wait_complete",
        )

    def engine(self, tiers: str, draft: str) -> Any:
        cfg = EngineConfig(
            model=self.model_dir,
            tiers=tiers,
            spec_draft=draft,
            spec_tokens=SPEC_TOKENS,
            model_cache_dir=self.cache_dir,
        )
        built = build_engine(cfg, self.cache, model=self.model)
        ids = getattr(getattr(built.engine.spec, "draft", None), "vocab_ids", None)
        self.head_rows = None if ids is None else len(ids)  # a reduced NextN output head
        return built

    def serve(self, tiers: str, draft: str, demote: bool = False, fresh: bool = False) -> dict:
        """Every round on one engine (or a fresh one per round): requests and timing."""
        built = None if fresh else self.engine(tiers, draft)
        reqs: list[Request] = []
        busy = 0.0
        for k, prompts in enumerate(self.rounds):
            cur = built or self.engine(tiers, draft)
            batch = [Request(f"s{s}t{k}", p, self.max_new) for s, p in enumerate(prompts)]
            start = time.perf_counter()
            cur.engine.run(batch)
            busy += time.perf_counter() - start
            cur.engine.drain()
            cur.engine.check_integrity()
            if demote:
                _demote(cur.engine)
            if fresh:
                cur.close()
            reqs += batch
        if built is not None:
            built.close()
        return _summary(reqs, busy)


def _summary(reqs: list[Request], busy: float) -> dict[str, Any]:
    proposed = sum(r.spec_proposed for r in reqs)
    accepted = sum(sum(r.spec_accepts) for r in reqs)
    later = [r for r in reqs if not r.rid.endswith("t0")]  # rounds whose prefix is a hit
    return {
        "acceptance": accepted / proposed if proposed else 0.0,
        "accept_length": sum(r.accept_length for r in reqs) / len(reqs),
        "tokens_per_s": sum(len(r.output) for r in reqs) / busy,
        "decode_tokens_per_s": decode_rate(reqs),
        "hits": {t: sum(r.hits[t] for r in later) for t in ("device", "host", "storage")},
        "outputs": {r.rid: r.output for r in reqs},
        "accepts": {r.rid: r.spec_accepts for r in reqs},
    }


def decode_rate(reqs: list[Request]) -> float:
    """Tokens after the first over the time between each request's first token and its finish
    (summed over requests): the decoding speed, which speculation changes, without the prompt's
    prefill, which it does not."""
    tokens = sum(len(r.output) - 1 for r in reqs)
    spans = [r.finish_s - r.first_token_s for r in reqs if r.finish_s and r.first_token_s]
    return tokens / sum(spans) if sum(spans) > 0 else 0.0


def draft_cost_ratio(model: DecoderLM, draft: str, head_rows: int | None = None) -> float | None:
    """Weights a draft pass reads over a target pass's (decode at small batch reads every
    weight once per pass): (K layers + head) / (all layers + head), K = 1 for a NextN layer
    (its eh_proj adds 2 hidden^2, its head `head_rows` rows: all by default); None for other
    drafts. Speculation with N = 1 beats plain decoding only if acceptance exceeds about this."""
    s = model.spec
    kv = s.num_kv_heads * s.head_dim
    layer = 2 * s.hidden_size * (s.hidden_size + kv) + 3 * s.hidden_size * s.intermediate_size
    head = s.vocab_size * s.hidden_size
    if draft == "nextn":
        rows = (head_rows or s.vocab_size) * s.hidden_size
        return (layer + 2 * s.hidden_size**2 + rows) / (s.num_layers * layer + head)
    if not draft.startswith("self:"):
        return None
    k = int(draft[len("self:") :])
    return (k * layer + head) / (s.num_layers * layer + head)


def measure(
    model: DecoderLM,
    rounds: Rounds,
    max_new: int,
    tmp: Path,
    draft: str = DRAFT,
    cache_dir: str = "",
    model_dir: str = "",
) -> dict[str, Any]:
    """The report; `cache_dir` holds the self:K checkpoint or trained NextN layer (empty: the
    model cache dir); `model_dir` is the model's checkpoint (empty: SmolLM2)."""
    run = _Runner(model, rounds, max_new, tmp, cache_dir, model_dir)
    pairs = [(run.serve("none", ""), run.serve("none", draft)) for _ in range(TIMING_PAIRS)]
    plain, cold = pairs[0]
    cases = {
        "device": run.serve(
            "device_host_storage", draft
        ),  # also fills storage for the fresh engines below
        "host": run.serve("device_host", draft, demote=True),
        "storage": run.serve("device_host_storage", draft, fresh=True),
    }
    report: dict[str, Any] = {"draft": draft, "spec_tokens": SPEC_TOKENS, "page_size": PAGE}
    report["draft_head_rows"] = run.head_rows or model.vocab_size
    report["draft_cost_ratio"] = draft_cost_ratio(model, draft, run.head_rows)
    report["load_average_1m"] = os.getloadavg()[0]  # a shared machine: the figures' context
    report["acceptance_cold"] = cold["acceptance"]
    for name, case in cases.items():
        report[f"acceptance_{name}"] = case["acceptance"]
        report[f"{name}_hit_pages"] = case["hits"][name]
    report["accept_length_cold"] = cold["accept_length"]
    report["tokens_per_s_spec"] = statistics.median(c["tokens_per_s"] for _, c in pairs)
    report["tokens_per_s_plain"] = statistics.median(p["tokens_per_s"] for p, _ in pairs)
    report["spec_over_plain"] = statistics.median(
        c["tokens_per_s"] / p["tokens_per_s"] for p, c in pairs
    )
    for key in ("decode_tokens_per_s",):
        report[f"{key}_spec"] = statistics.median(c[key] for _, c in pairs)
        report[f"{key}_plain"] = statistics.median(p[key] for p, _ in pairs)
    report["spec_over_plain_decode"] = statistics.median(
        c["decode_tokens_per_s"] / p["decode_tokens_per_s"] for p, c in pairs
    )
    runs = [cold, *(c for _, c in pairs[1:]), *cases.values()]
    report["outputs_identical"] = all(r["outputs"] == plain["outputs"] for r in runs)
    report["acceptance_sequences_identical"] = all(r["accepts"] == cold["accepts"] for r in runs)
    report["acceptance_equal_after_restores"] = all(
        report[f"acceptance_{n}"] == report["acceptance_cold"] for n in cases
    )
    return report


@BENCHES.register("spec")
def bench_spec(quick: bool) -> dict[str, Any]:
    """SmolLM2-135M-Instruct, its NextN layer drafts 1 token; the agent workload (quick: smaller)."""
    path = resolve_model_path(EngineConfig())
    model = load_model(path)
    spec = QUICK if quick else FULL
    sessions = build_workload(spec, model.vocab_size, Tokenizer(path).encode_chat)
    rounds = [[s[k] for s in sessions] for k in range(spec.turns)]
    with tempfile.TemporaryDirectory(prefix="kvstrata-spec-") as tmp:
        return measure(model, rounds, spec.max_new_tokens, Path(tmp), model_dir=str(path))

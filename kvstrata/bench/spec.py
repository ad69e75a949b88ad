"""`kvstrata bench spec`: speculative decoding of SmolLM2 with its NextN draft layer on the agent
workload, in one run: output tokens/s with and without speculation, and acceptance on a cold
cache and after restores from device, host (forced demotion after every round) and storage (a fresh
engine every round).

The sessions' turn k run together as round k; turn k's prompt extends turn k-1's, so from round 1
on each prompt's prefix is a hit from the tier under test. Goal: acceptance after every restore
equals cold to the last digit (each request's acceptance sequence too), outputs equal plain
greedy decoding.

The draft is `nextn`: a NextN layer trained here for SmolLM2 (kvstrata.model.nextn_train, built
on first use and cached; `--model DIR`: that checkpoint's own NextN layer). Break-even: a step
costs N draft passes (r each, in target passes: one layer + the shared 49k-token head,
r = `draft_cost_ratio`) and one verify pass, and emits
1 + a tokens. `self:K` drafts cannot win on SmolLM2 (r = 0.90 at K = 26, the least K whose
acceptance is meaningful); the NextN layer's r is about 0.24 with the whole vocabulary, less
with the reduced output head the trained layer carries (`draft_head_rows`).

Speed is measured on what an agent session does turn after turn: it resends its whole history
plus a new turn and reads a reply of `max_new_tokens` (QUICK 96, FULL 128). Each timed run is a
fresh engine with the prefix cache in device memory; the sessions' first turn is prefilled
untimed (1 new token), then rounds 1.. are timed: each prompt's history (the previous turn's
prompt) is a prefix hit, its new turn (action, tool output, question: 150-300 tokens) is
prefilled, and the reply decoded. Plain and speculative runs take identical prompts and cache
states (`cache_states_identical`: the same hit pages in every timed run) and alternate
TIMING_PAIRS times (plain first in even pairs, speculative first in odd ones); `tokens_per_s_*`
are the medians (output tokens over the timed rounds' wall time, prefill of the new turns
included), `spec_over_plain` their ratio; `decode_tokens_per_s_*` count tokens after each
request's first over the time from its first token to its finish; `decode_step_ms_*` is the
mean wall time of the steps in which every request decodes (a plain step, or a verify with its
drafts): `step_ms_*` averages the prompt steps in too, and as speculation takes fewer decode
steps they weigh more there. `timed_workload` states the
timed runs' shape in words. The report also carries the machine's load average and torch's
thread count.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvstrata.bench.registry import BENCHES
from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine, resolve_model_path
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request, State
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM
from kvstrata.model.tokenizer import chat_encoder
from kvstrata.workloads.agent import WorkloadSpec, build_workload

# N = 1 by measurement (quick's timed runs, one run each, 1 thread, load ~6): decode steps 120
# at N = 1 (acceptance 0.67), 106 at N = 2 (0.47) and N = 3 (0.32), for 190 plain ones; CPU ms
# per decode step: plain 96, N = 1 100, N = 2 134, N = 3 133 (the chained drafts are rarely
# accepted, and each adds a draft pass and a verify row per sequence)
DRAFT, SPEC_TOKENS, PAGE = "nextn", 1, 64
TIMING_PAIRS = 3  # plain and speculative runs alternate; the figures are the pairs' medians
QUICK = WorkloadSpec(sessions=2, turns=3, first_lines=10, tool_lines=6, max_new_tokens=96)
FULL = WorkloadSpec(sessions=2, turns=4, first_lines=30, tool_lines=12, max_new_tokens=128)
Rounds = list[list[list[int]]]  # [turn][session] -> prompt
LLAMA_LAYERS = ("LlamaForCausalLM", "Qwen2ForCausalLM")  # draft_cost_ratio's weight count


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
            spec_draft=draft,
            spec_tokens=SPEC_TOKENS,
            model_cache_dir=self.cache_dir,
        )
        built = build_engine(cfg, self.cache.with_tiers(tiers), model=self.model)
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
            busy += _timed_run(cur.engine, batch).wall_s
            if demote:
                _demote(cur.engine)
            if fresh:
                cur.close()
            reqs += batch
        if built is not None:
            built.close()
        return _summary(reqs, busy)

    def timed(self, draft: str) -> dict:
        """The timed workload: a fresh engine with the prefix cache in device memory; round 0
        is prefilled untimed (its history cached, 1 new token); rounds 1.. are timed: each
        prompt's history (the previous turn's prompt) is a hit, its new turn is prefilled and
        `max_new` tokens are decoded."""
        built = self.engine("device", draft)
        warm = [Request(f"s{s}w", p, 1) for s, p in enumerate(self.rounds[0])]
        _timed_run(built.engine, warm)
        reqs: list[Request] = []
        spent = Spent()
        for k, prompts in enumerate(self.rounds[1:], start=1):
            batch = [Request(f"s{s}t{k}", p, self.max_new) for s, p in enumerate(prompts)]
            spent = spent + _timed_run(built.engine, batch)
            reqs += batch
        built.close()
        return {**_summary(reqs, spent.wall_s), **spent.per_step()}


@dataclasses.dataclass(frozen=True)
class Spent:
    """Where a timed run's wall time went."""

    wall_s: float = 0.0
    """Serving, end to end."""
    steps: int = 0
    """Engine steps (prefill and decode/verify alike)."""
    draft_s: float = 0.0
    """In the draft's passes (SpecStats.draft_s)."""
    decode_steps: int = 0
    """Steps with every request decoding (no prompt chunk in them): plain decode or verify."""
    decode_s: float = 0.0
    """Wall seconds of those steps."""

    def __add__(self, other: Spent) -> Spent:
        return Spent(*(a + b for a, b in zip(_fields(self), _fields(other), strict=True)))

    def per_step(self) -> dict[str, float]:
        """The step breakdown: ms per engine step, and of it in the draft and the rest (the
        target's forward or verify, sampling, acceptance and cache bookkeeping)."""
        step = 1000 / max(self.steps, 1)
        return {
            "steps": self.steps,
            "step_ms": self.wall_s * step,
            "draft_ms_per_step": self.draft_s * step,
            "rest_ms_per_step": (self.wall_s - self.draft_s) * step,
            # step_ms averages the prompt steps in: fewer decode steps weigh them more
            "decode_step_ms": self.decode_s * 1000 / max(self.decode_steps, 1),
        }


def _fields(spent: Spent) -> list[float]:
    return [getattr(spent, f.name) for f in dataclasses.fields(spent)]


def _timed_run(eng: Engine, batch: list[Request]) -> Spent:
    """Serve `batch` to the end (Engine.run's loop, each step timed): the serving's wall
    seconds, steps, draft seconds and decode-only steps (the drain and checks after it are not
    counted)."""
    steps, draft_s = eng.steps, _draft_s(eng)
    decode_steps, decode_s = 0, 0.0
    start = time.perf_counter()
    for req in batch:
        eng.submit(req)
    while eng.has_work():
        decoding = not eng.scheduler.waiting and all(r.state is State.DECODE for r in eng.running)
        began = time.perf_counter()
        eng.step()
        if decoding:
            decode_steps, decode_s = decode_steps + 1, decode_s + time.perf_counter() - began
    busy = time.perf_counter() - start
    spent = Spent(busy, eng.steps - steps, _draft_s(eng) - draft_s, decode_steps, decode_s)
    eng.drain()
    eng.check_integrity()
    return spent


def _draft_s(eng: Engine) -> float:
    return eng.spec.stats.draft_s if eng.spec is not None else 0.0


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
        "prompt_tokens": sum(len(r.tokens) for r in reqs),
        "output_tokens": sum(len(r.output) for r in reqs),
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
    drafts and for layers other than Llama's (GQA + SwiGLU, which the count assumes).
    Speculation with N = 1 beats plain decoding only if acceptance exceeds about this."""
    s = model.spec
    if s.architecture not in LLAMA_LAYERS:
        return None
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


def _timing(run: _Runner, draft: str, pairs: int) -> dict[str, Any]:
    """`pairs` timed runs of each kind, alternating (plain first in even pairs, speculative
    first in odd ones) on identical prompts and cache states: tokens/s medians and their
    ratio, the timed workload's shape, and the runs themselves (for the identity checks)."""
    plain, spec = [], []
    for i in range(pairs):
        for kind in ("", draft) if i % 2 == 0 else (draft, ""):
            (spec if kind else plain).append(run.timed(kind))
    first = plain[0]
    new_prompt = first["prompt_tokens"] - PAGE * first["hits"]["device"]
    report: dict[str, Any] = {
        "timed_workload": (
            f"{len(run.rounds) - 1} rounds x {len(run.rounds[0])} sessions of a multi-turn agent "
            "session, after an untimed first turn, prefix cache in device memory: over the "
            f"{len(first['outputs'])} timed requests {first['prompt_tokens']} prompt tokens, of "
            f"which {new_prompt} prefilled (the rest: the history, prefix hits), and "
            f"{first['output_tokens']} new tokens ({run.max_new} per request)"
        ),
        "timed_requests": len(first["outputs"]),
        "timed_prompt_tokens": first["prompt_tokens"],
        "timed_prefilled_tokens": new_prompt,
        "timed_new_tokens": first["output_tokens"],
        "timing_pairs": pairs,
        "cache_states_identical": all(r["hits"] == first["hits"] for r in plain + spec),
    }
    for key in ("tokens_per_s", "decode_tokens_per_s"):
        report[f"{key}_spec"] = statistics.median(r[key] for r in spec)
        report[f"{key}_plain"] = statistics.median(r[key] for r in plain)
    report["spec_over_plain"] = report["tokens_per_s_spec"] / report["tokens_per_s_plain"]
    report["spec_over_plain_decode"] = (
        report["decode_tokens_per_s_spec"] / report["decode_tokens_per_s_plain"]
    )
    for key in ("steps", "step_ms", "draft_ms_per_step", "rest_ms_per_step", "decode_step_ms"):
        report[f"{key}_spec"] = statistics.median(r[key] for r in spec)
        report[f"{key}_plain"] = statistics.median(r[key] for r in plain)
    report["acceptance_timed"] = statistics.median(r["acceptance"] for r in spec)
    report["accept_length_timed"] = statistics.median(r["accept_length"] for r in spec)
    return {"report": report, "runs": plain + spec, "spec": spec}


def measure(
    model: DecoderLM,
    rounds: Rounds,
    max_new: int,
    tmp: Path,
    draft: str = DRAFT,
    cache_dir: str = "",
    model_dir: str = "",
    pairs: int = TIMING_PAIRS,
) -> dict[str, Any]:
    """The report; `cache_dir` holds the self:K checkpoint or trained NextN layer (empty: the
    model cache dir); `model_dir` is the model's checkpoint (empty: SmolLM2)."""
    run = _Runner(model, rounds, max_new, tmp, cache_dir, model_dir)
    plain, cold = run.serve("none", ""), run.serve("none", draft)
    timing = _timing(run, draft, pairs)
    cases = {
        # also fills storage for the fresh engines of "storage"
        "device": run.serve("device_host_storage", draft),
        "host": run.serve("device_host", draft, demote=True),
        "storage": run.serve("device_host_storage", draft, fresh=True),
    }
    report: dict[str, Any] = {"draft": draft, "spec_tokens": SPEC_TOKENS, "page_size": PAGE}
    report["draft_head_rows"] = run.head_rows or model.vocab_size
    report["draft_cost_ratio"] = draft_cost_ratio(model, draft, run.head_rows)
    report["load_average_1m"] = os.getloadavg()[0]  # a shared machine: the figures' context
    report["threads"] = torch.get_num_threads()
    report["acceptance_cold"] = cold["acceptance"]
    for name, case in cases.items():
        report[f"acceptance_{name}"] = case["acceptance"]
        report[f"{name}_hit_pages"] = case["hits"][name]
    report["accept_length_cold"] = cold["accept_length"]
    report.update(timing["report"])
    runs = [cold, *timing["runs"], *cases.values()]
    report["outputs_identical"] = all(_agrees(r["outputs"], plain["outputs"]) for r in runs)
    specs = [cold, *timing["spec"], *cases.values()]
    report["acceptance_sequences_identical"] = all(
        _agrees(r["accepts"], cold["accepts"]) for r in specs
    )
    report["acceptance_equal_after_restores"] = all(
        report[f"acceptance_{n}"] == report["acceptance_cold"] for n in cases
    )
    return report


def _agrees(part: dict[str, list[int]], whole: dict[str, list[int]]) -> bool:
    """Every request of `part` (a run of some rounds) has `whole`'s value for it."""
    return all(whole.get(rid) == value for rid, value in part.items())


@BENCHES.register("spec")
def bench_spec(quick: bool, model: str | None = None) -> dict[str, Any]:
    """The checkpoint at `model` (default SmolLM2-135M-Instruct), its NextN layer drafting
    SPEC_TOKENS tokens; the agent workload (quick: smaller), as token ids where the checkpoint
    ships no tokenizer."""
    path = Path(model) if model else resolve_model_path(EngineConfig())
    target = load_model(path)
    spec = QUICK if quick else FULL
    tok = chat_encoder(path)
    sessions = build_workload(spec, target.vocab_size, tok.encode_chat if tok else None)
    rounds = [[s[k] for s in sessions] for k in range(spec.turns)]
    with tempfile.TemporaryDirectory(prefix="kvstrata-spec-") as tmp:
        report = measure(target, rounds, spec.max_new_tokens, Path(tmp), model_dir=str(path))
    return {"model": str(path), "architecture": target.spec.architecture, **report}

"""The `pd` row of `kvstrata run --pd`: the run's workload through a router,
one prefill and one decode worker (LocalPD: local processes sharing one storage directory under
--out), with the run's engine and cache settings.

The workers answer in text, so the row joins the identical-outputs check by text: each of its
answers must equal the reference configuration's tokens decoded by the checkpoint's codec (the
same decoder the server uses). Requests set `ignore_eos`, as the in-process engine runs every
request to max_new_tokens. The row's figures: hit rates and TTFT from the decode worker's
usage (what it held, by tier) and the client's clock; bytes moved between tiers: both workers'
`kvstrata:kv_moved_bytes` read from /metrics before they stop; `pd_bytes_sent`: KV bytes prefill
sent decode, with pages sent and skipped.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.bench.pd_load import Turn, drive
from kvstrata.bench.run_report import TurnResult, config_report
from kvstrata.cache.counters import DIRECTIONS, TIERS
from kvstrata.configtools import config_to_args
from kvstrata.ranks.config import DistConfig

PD = "pd"
ENGINE_SKIP = ("model", "model_cache_dir", "spec_draft", "spec_tokens")
"""Set by LocalPD (model; the storage URL, its shared store) or not used by the row (speculation: the
tokens are the same without it)."""


def pd_row_by_default(dist_cfg: DistConfig) -> bool:
    """`run` without --pd/--no-pd: the row is on wherever check_pd_args allows it."""
    return dist_cfg.world_size == 1


def check_pd_args(dist_cfg: DistConfig) -> None:
    """The row's workers run on one rank (P/D workers refuse --tp/--cp/--pp > 1 for now)."""
    if dist_cfg.world_size > 1:
        raise ValueError("--pd runs one-rank P/D workers: not with --tp/--cp/--pp > 1")


def worker_args(cfgs: Sequence[Any]) -> tuple[str, ...]:
    """`kvstrata serve` options of both workers: the run's engine and cache settings."""
    engine_cfg, cache_cfg = cfgs[0], cfgs[1]
    args = config_to_args(engine_cfg, exclude=ENGINE_SKIP)
    return (*args, *config_to_args(cache_cfg, exclude=("storage_url",)))


@dataclass
class PDRow:
    """The row's turns (with text and usage) and their report."""

    turns: list[Turn]
    page_size: int
    bytes_moved: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(DIRECTIONS.values(), 0)
    )
    """Both workers' KV bytes moved between tiers, by direction (host->device, ...)."""
    results: list[TurnResult] = field(init=False)

    def __post_init__(self) -> None:
        self.results = [self._result(t) for t in self.turns]

    def _result(self, t: Turn) -> TurnResult:
        by_tier = (t.usage.get("prompt_tokens_details") or {}).get("cached_tokens_by_tier") or {}
        hits = dict.fromkeys(TIERS, 0)
        for name, tokens in by_tier.items():
            hits[name] = int(tokens) // self.page_size
        rid = f"s{t.session}t{t.turn}"
        return TurnResult(
            t.session, t.turn, rid, t.prompt_tokens, [], hits, t.ttft_s, self.page_size
        )

    def report(self) -> dict[str, Any]:
        rep = config_report(self.results, None)
        rep["bytes_moved"] = dict(self.bytes_moved)
        text = {f"s{t.session}t{t.turn}": t.text for t in self.turns}
        for req in rep["requests"]:  # the workers answer text, not token ids
            req.pop("output")
            req["text"], req["pd"] = text[req["rid"]], self._pd_of(req["rid"])
        pd = [t.pd for t in self.turns]
        rep["pd_bytes_sent"] = sum(u.get("bytes_received", 0) for u in pd)
        rep["pd_pages_sent"] = sum(u.get("pages_received", 0) for u in pd)
        rep["pd_pages_skipped"] = sum(u.get("pages_skipped", 0) for u in pd)
        rep["pd_pages_from_storage"] = sum(u.get("pages_from_storage", 0) for u in pd)
        rep["pd_prefill_computed_tokens"] = sum(u.get("prefill_computed_tokens", 0) for u in pd)
        return rep

    def _pd_of(self, rid: str) -> dict[str, Any]:
        return next(t.pd for t in self.turns if f"s{t.session}t{t.turn}" == rid)

    def same_text(self, reference: list[TurnResult], decode: Callable[[list[int]], str]) -> bool:
        """Every answer equals the reference configuration's tokens, decoded."""
        want = {r.rid: decode(r.output) for r in reference}
        got = {f"s{t.session}t{t.turn}": t.text for t in self.turns}
        return got == want


def run_pd_row(
    model_path: Path,
    cfgs: Sequence[Any],
    prompts: Sequence[Sequence[list[int]]],
    max_new: int,
    out_dir: Path,
    tick: Callable[[], None] = lambda: None,
) -> PDRow:
    """Start LocalPD (fresh store under out_dir), serve every session, stop it (all exit 0)."""
    from kvstrata.bench.local_pd import LocalPD, LocalPDConfig

    store = out_dir / "pd-store"
    shutil.rmtree(store, ignore_errors=True)  # a cold start, like the other rows
    cfg = LocalPDConfig(
        model=str(model_path), store_dir=str(store), log_dir=str(out_dir / "pd-logs"),
        worker_args=worker_args(cfgs),
    )  # fmt: skip
    pd = LocalPD(cfg).start()
    try:
        extra = {"ignore_eos": True}
        turns = drive(pd.url, prompts, max_new, len(prompts), tick, extra=extra)
        moved = [moved_bytes(w.url) for w in pd.workers.values()]
    finally:
        codes = pd.stop()
    if any(codes.values()):
        raise RuntimeError(f"pd row: processes did not exit 0: {codes}; logs in {cfg.log_dir}")
    total = {d: sum(m.get(d, 0) for m in moved) for d in DIRECTIONS.values()}
    return PDRow(turns, cfgs[1].page_size, total)


def moved_bytes(url: str, timeout_s: float = 10.0) -> dict[str, int]:
    """A worker's `kvstrata:kv_moved_bytes` by direction, from its /metrics."""
    text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s).raise_for_status().text
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvstrata:kv_moved_bytes":
            for sample in family.samples:
                if sample.name.endswith("_total") or sample.name == family.name:
                    out[sample.labels["direction"]] = int(sample.value)
    return out

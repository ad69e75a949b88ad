"""`kvstrata bench agent`: agent sessions with tool-call gaps through `kvstrata serve`, with no
hints, with `cache_control` pins on every turn, and with pins + a prefetch hint when each tool
call ends (kvstrata/bench/agent_load.py), in one run.

Each arm gets a fresh server with the same configs: device + host pools small enough that the
sessions' histories compete for them (with the full spec the histories are over twice the
device + host capacity), and a storage tier (a fresh directory per arm) that evicted pages fall
back to. Reported per arm: TTFT p50/p90, hit rate by tier, pages pinned per tier at the end,
pins made / expired / dropped or refused for budget, hints sent, and the TTFT of the sessions
that send no hints. Top level: the ratios to the no-hints arm (`ttft_p90_pins_over_none`,
`ttft_p50_pins_prefetch_over_none`, `unhinted_ttft_over_none`: the worse hinted arm's TTFT p50
of the unhinted sessions over theirs with no hints anywhere).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import httpx2 as httpx

from kvstrata.bench.agent_load import ARMS, AgentSpec, ArmResult, run_arm
from kvstrata.bench.registry import BENCHES
from kvstrata.workloads.turn_gaps import GapSampler, find_trace, inter_turn_gaps_s

QUICK = AgentSpec(
    sessions=4, turns=3, first_lines=24, tool_lines=5, max_tokens=4, gap_scale=0.01,
    gap_cap_s=2.0, unhinted_every=4, page_size=64, device_pages=24, host_pages=32,
)  # fmt: skip
FULL = AgentSpec(
    sessions=12, turns=6, first_lines=24, tool_lines=5, max_tokens=8, gap_scale=0.03,
    gap_cap_s=10.0, unhinted_every=4, page_size=64, device_pages=24, host_pages=96,
)  # fmt: skip
BENCH_THREADS = 1  # torch threads of each arm's server


@BENCHES.register("agent")
def agent_bench(
    quick: bool,
    model: str | None = None,
    sessions: int | None = None,
    out: Path | None = None,
    trace: str | None = None,
) -> dict[str, Any]:
    from kvstrata.engine.build import resolve_model_path
    from kvstrata.engine.config import EngineConfig

    spec = QUICK if quick else FULL
    if sessions:
        spec = AgentSpec(**{**spec.__dict__, "sessions": sessions})
    sampler = GapSampler(inter_turn_gaps_s(find_trace(trace)), spec.gap_scale, spec.gap_cap_s, 0)
    path = resolve_model_path(EngineConfig(model=model or ""))
    return run_agent(spec, path, sampler, out or Path("kvstrata-out"))


def run_agent(spec: AgentSpec, path: Path, sampler: GapSampler, out_dir: Path) -> dict[str, Any]:
    """The three arms, one fresh server each, and the ratios to the no-hints arm."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": str(path), "spec": dict(spec.__dict__)}
    for arm in ARMS:
        report[arm] = _run_served(path, spec, arm, sampler, out_dir)
    none, pins, both = report["none"], report["pins"], report["pins_prefetch"]
    report["ttft_p90_pins_over_none"] = _ratio(pins["ttft_p90_s"], none["ttft_p90_s"])
    report["ttft_p50_pins_prefetch_over_none"] = _ratio(both["ttft_p50_s"], none["ttft_p50_s"])
    report["unhinted_ttft_over_none"] = max(
        _ratio(a["unhinted_ttft_p50_s"], none["unhinted_ttft_p50_s"]) for a in (pins, both)
    )
    report["errors"] = sum(report[a]["errors"] for a in ARMS)
    return report


def _run_served(
    path: Path, spec: AgentSpec, arm: str, sampler: GapSampler, out_dir: Path
) -> dict[str, Any]:
    from kvstrata.serve.process import ServerProcess

    store = out_dir / f"bench-agent-store-{arm}"
    _empty(store)
    args = [
        "--model", str(path), "--page-size", str(spec.page_size),
        "--device-pages", str(spec.device_pages), "--host-pages", str(spec.host_pages),
        "--storage-url", str(store), "--threads", str(BENCH_THREADS),
        "--max-pending", str(4 * spec.sessions),
    ]  # fmt: skip
    srv = ServerProcess(args, out_dir / f"bench-agent-{arm}.log")
    try:
        res = run_arm(srv.url, spec, arm, sampler)
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    finally:
        if srv.terminate() != 0:
            raise RuntimeError(f"server ({arm}) did not exit 0; see {srv.log}")
    return {**summarize(res), **pin_metrics(metrics)}


def _empty(store: Path) -> None:
    """A fresh storage directory: no arm reads another's pages."""
    import shutil

    if store.exists():
        shutil.rmtree(store)
    store.mkdir(parents=True)


def summarize(res: ArmResult) -> dict[str, Any]:
    ttfts = sorted(t.ttft_s for t in res.turns)
    unhinted = sorted(t.ttft_s for t in res.turns if not t.hinted)
    prompt = sum(t.prompt_tokens for t in res.turns)
    tiers = {
        tier: sum(t.by_tier.get(tier, 0) for t in res.turns)
        for tier in ("device", "host", "storage")
    }
    return {
        "requests": len(res.turns),
        "errors": len(res.errors),
        "error_messages": res.errors[:5],
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p90_s": _pct(ttfts, 0.9),
        "unhinted_ttft_p50_s": _pct(unhinted, 0.5),
        "hit_rate": sum(tiers.values()) / prompt if prompt else 0.0,
        "hit_rate_by_tier": {k: v / prompt if prompt else 0.0 for k, v in tiers.items()},
        "pinned_tokens_reported": sum(t.pinned_tokens for t in res.turns),
        "hints_sent": res.hints,
        "wall_s": res.wall_s,
    }


PIN_COUNTERS = ("pins_made", "pins_expired", "pins_dropped_for_budget", "pins_refused_for_budget")


def pin_metrics(text: str) -> dict[str, Any]:
    """The server's pin figures from /metrics: counters, and pages pinned per tier at the end."""
    out: dict[str, Any] = {}
    for name in PIN_COUNTERS:
        found = re.search(rf"^kvstrata:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        out[name] = float(found.group(1)) if found else 0.0
    out["pinned_pages_end"] = {
        tier: float(v)
        for tier, v in re.findall(
            r'^kvstrata:pinned_pages\{[^}]*tier="(\w+)"[^}]*\} (\S+)$', text, re.M
        )
    }
    return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")

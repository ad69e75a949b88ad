"""`kvstrata bench agent`: agent sessions with tool-call gaps through `kvstrata serve`, with no
hints, with `cache_control` pins on every turn, and with pins + a prefetch hint when each tool
call ends (kvstrata/bench/agent_load.py), in one run.

The three arms run in turn, `rounds` times (FULL: twice), each run on a fresh server, and each
arm's turns are pooled over its rounds. Every server has the same configs: device + host pools
small enough that the sessions compete for them, a pin budget (the default half of the host
pool) that the hinted sessions' histories fit, a storage tier (a fresh directory per arm)
that evicted pages fall back to, and prefill planned shortest first (`AgentSpec.prefill_order`).
The storage is the shared store agents' servers have, a remote one: a page read from it waits
`storage_read_s_per_page` (the server's `--storage-emulate-read-s-per-page`), about 2/3 of what
computing the page costs SmolLM2 on one core. A local file store would read a page in a few ms, as fast as the host tier: there,
keeping a page in host memory could not matter.

The sessions are shaped as coding agents' are: every one opens with the same long system prompt
(instructions, tool definitions, a repository map), so a first turn computes only its task; each
later turn resends the history and adds a short part (the tool call, its output, a question), so
what the cache kept of the history decides a returning turn's TTFT. The hinted sessions' tools
run longer than the others' (`hinted_gap_x`), the case hints are for. The sessions that send no
hints start first and carry larger histories: their returning turns reload them from storage,
which pushes other pages out of the host tier through the storage workers rather than through
prefill on the core the hinted turns need.

Reported per arm, for the sessions that send hints and for those that never do: TTFT p50/p90,
prompt tokens by where they came from (device, host, storage, computed; `history_computed`:
computed tokens the session had sent before), and how many other turns were in flight when
each was sent; per arm: pins made / expired / dropped or refused for budget, pinned pages at
the end, hints sent, storage reloads complete / partial / empty / stopped (cut short by the
budget, or by a request that let its lease go), and a turn log (send time, TTFT, tokens by
tier, turns in flight). Top level, the ratios to the no-hints arm over the same sessions' same
turns: `ttft_p90_pins_over_none` and `ttft_p50_pins_prefetch_over_none` (the hinted sessions),
`unhinted_ttft_over_none` (the sessions that send no hints: the worse hinted arm's TTFT p50 over
theirs in the no-hints arm); `returning_turns`: the same three over the turns after each
session's first (a first turn finds no history of its own in any arm); and
`unhinted_ttft_paired_over_none`: per unhinted turn, its TTFT over the same turn's in the
no-hints arm, the median (the worse hinted arm). The pooled p50 ratio moves by +-10% with which
turns happen to sit around the median; the paired one compares each request with itself.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import httpx2 as httpx

from kvstrata.bench.agent_load import ARMS, AgentSpec, ArmResult, Turn, run_arm
from kvstrata.bench.registry import BENCHES
from kvstrata.workloads.turn_gaps import GapSampler, find_trace, inter_turn_gaps_s

# Sizes (SmolLM2 on one core: a page of 64 tokens' prefill ~125 ms; host -> device a few ms; a
# page from the emulated remote store 80 ms; up to 4 requests' reads at once: the server's
# storage workers).
# FULL, why each size:
# - the system prompt every session shares: 606 tokens (9 full pages; agents' instructions and
#   tool schemas are the largest shared part of their prompts). Hot in every arm, so a first
#   turn computes only its task and cold first turns stay short;
# - 3 hinted sessions x 7 turns (21 turns an arm, 18 returning): a first turn adds ~190 tokens
#   (3 pages), each later turn ~100 (a call, 3 lines of output, a question): prompts ~785 ->
#   ~1400 tokens. A returning turn computes 2-3 pages and finds up to 12 pages of its own
#   history: up to ~1 s from the remote store, a few ms from host;
# - pins: at most 9 + 3 x 12 = 45 distinct pages, within the budget (half the host pool: 48);
# - 9 unhinted sessions x 9 turns start first, 1.5 s apart; the hinted ones from 20 s on, after
#   the unhinted first turns' prefill (28 lines, ~10 pages each). Their histories (~19 -> ~32
#   pages) do not survive their own tool calls, so each returning unhinted turn reloads ~10-22
#   pages from storage: that pushes the hinted histories out of a recency-only host tier
#   without prefill on the core, in every arm alike. Their 9 turns span the hinted sessions' 7
#   longer tool calls, so the competition lasts as long as the hinted sessions do;
# - tool calls: the trace's gaps x0.25, at most 20 s (mean ~11 s); a hinted session's run 1.5x
#   as long (`hinted_gap_x`: mean ~16 s): the case hints are for, a session whose tool runs
#   long (a build, a test suite) while the others keep sending. With equal gaps most hinted
#   histories outlived their tool calls in device or host under recency alone (no-hints arm:
#   102 of ~250 history pages from storage), and there was little for pins to save;
# - device 80 pages: two of the largest unhinted prompts (~32 pages) beside a hinted turn. With
#   64, hinted turns waited for one of two running unhinted prompts to end, whatever the cache
#   held (4 of 21 in one traced arm, up to 1.4 s); with 40, every third turn did. Host 96:
#   the final prompts sum to ~355 pages, over twice device + host (352);
# - two rounds of the three arms, each arm's turns pooled: one run's TTFT p50 moves by +-10-15%
#   with how its turns happened to queue (nine single runs of the unhinted ratio, whose true
#   value is ~1, spread 0.77-1.24); two rounds halve that spread's variance, in ~20 minutes;
# - the servers' reload budget (`READ_BUDGET_X`): the 4 storage workers read different
#   requests' reloads together, so a reload may queue behind others before its own reads start.
#   At 2x the store's read time, ~20-page unhinted reloads queued that way ran out of budget in
#   the hinted arms (4-5 an arm in one traced run, none in the no-hints arm); a stopped reload
#   lands none of its pages, and its history (~1450 tokens, ~4 s of the core) is computed
#   again, in front of every hinted turn behind it;
# - prefill shortest first (`prefill_order`): once a hinted history is kept, the turn's TTFT is
#   the wait for the core. In admission order a returning turn that computes ~100 tokens waited
#   behind cold prompts admitted before it (one day, pins p90 / pins + prefetch p50 / unhinted:
#   0.86 / 0.48 / 1.21 in admission order; 0.58 / 0.39 / 1.10, 0.39 / 0.38 / 1.10 and 0.64 /
#   0.56 / 1.18 shortest first).
QUICK = AgentSpec(
    sessions=5, hinted_sessions=2, turns=3, unhinted_turns=3, map_lines=20, first_lines=3,
    unhinted_first_lines=28, tool_lines=3, max_tokens=4, gap_scale=0.05, gap_cap_s=8.0,
    start_every_s=1.0, hinted_start_s=3.0, page_size=64, device_pages=40, host_pages=64,
    storage_read_s_per_page=0.08, hinted_gap_x=1.5,
)  # fmt: skip
FULL = AgentSpec(
    sessions=12, hinted_sessions=3, turns=7, unhinted_turns=9, map_lines=20, first_lines=3,
    unhinted_first_lines=28, tool_lines=3, max_tokens=4, gap_scale=0.25, gap_cap_s=20.0,
    start_every_s=1.5, hinted_start_s=20.0, page_size=64, device_pages=80, host_pages=96,
    storage_read_s_per_page=0.08, rounds=2, hinted_gap_x=1.5,
)  # fmt: skip
BENCH_THREADS = 1  # torch threads of each arm's server
READ_BUDGET_X = 4.0  # the servers' prefetch budget per page, over the store's read time


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
    report: dict[str, Any] = {
        "model": str(path),
        "spec": dict(spec.__dict__),
        "storage": f"file store, each page read waits {spec.storage_read_s_per_page:g} s "
        "(emulates a remote shared store)",
    }
    pooled = {arm: ArmResult() for arm in ARMS}
    counters: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for round_ in range(spec.rounds):  # arms in turn, so a slow spell of the machine hits all
        for arm in ARMS:
            res, metrics = _run_served(path, spec, arm, sampler, out_dir)
            pooled[arm].add(res, round_)
            counters[arm].append(metrics)
    for arm in ARMS:
        report[arm] = {**summarize(pooled[arm]), **_summed(counters[arm])}
    report.update(_goal_ratios(report, "hinted", "unhinted"))
    report["unhinted_ttft_paired_over_none"] = max(
        paired_ttft_ratio(pooled[arm], pooled["none"], hinted=False) for arm in ARMS[1:]
    )
    # the same ratios over returning turns only (a first turn finds no history in any arm)
    report["returning_turns"] = _goal_ratios(report, "hinted_returning", "unhinted_returning")
    report["errors"] = sum(report[a]["errors"] for a in ARMS)
    report.update(_flat(report))
    return report


def _goal_ratios(report: dict[str, Any], hinted: str, unhinted: str) -> dict[str, float]:
    """The goals' ratios to the no-hints arm, over the given groups of turns."""
    none, pins, both = (report[a] for a in ARMS)
    return {
        "ttft_p90_pins_over_none": _ratio(pins[hinted]["ttft_p90_s"], none[hinted]["ttft_p90_s"]),
        "ttft_p50_pins_prefetch_over_none": _ratio(
            both[hinted]["ttft_p50_s"], none[hinted]["ttft_p50_s"]
        ),
        "unhinted_ttft_over_none": max(
            _ratio(a[unhinted]["ttft_p50_s"], none[unhinted]["ttft_p50_s"]) for a in (pins, both)
        ),
    }


def paired_ttft_ratio(arm: ArmResult, none: ArmResult, hinted: bool) -> float:
    """The median, over the hinted (or the unhinted) sessions' turns, of each turn's TTFT over
    the same turn's (same round, session and turn) in the no-hints arm: what each request
    paid against itself, free of which other turns happened to fall around the pooled p50."""
    base = {(t.round, t.session, t.turn): t.ttft_s for t in none.turns if t.hinted == hinted}
    ratios = sorted(
        t.ttft_s / base[key]
        for t in arm.turns
        if t.hinted == hinted and base.get(key := (t.round, t.session, t.turn), 0) > 0
    )
    return _pct(ratios, 0.5)


def _flat(report: dict[str, Any]) -> dict[str, Any]:
    """The per-arm figures a table shows (scalars at the top level)."""
    out: dict[str, Any] = {f"returning.{k}": v for k, v in report["returning_turns"].items()}
    for arm in ARMS:
        r = report[arm]
        for who in ("hinted", "unhinted"):
            g = r[who]
            out[f"{arm}.{who}.ttft_p50_s"] = g["ttft_p50_s"]
            out[f"{arm}.{who}.ttft_p90_s"] = g["ttft_p90_s"]
            tokens = g["prompt_tokens_from"]
            out[f"{arm}.{who}.tokens_dev/host/storage/computed"] = "/".join(
                str(tokens[k]) for k in ("device", "host", "storage", "computed")
            )
        out[f"{arm}.in_flight_mean/max"] = f"{r['in_flight_mean']:.2f}/{r['in_flight_max']}"
        out[f"{arm}.pins_made/expired/dropped"] = "/".join(
            f"{r[k]:g}" for k in ("pins_made", "pins_expired", "pins_dropped_for_budget")
        )
        out[f"{arm}.reloads_complete/partial/empty/stopped"] = "/".join(
            f"{r[f'reloads_{o}']:g}" for o in PREFETCH_OUTCOMES
        )
        out[f"{arm}.pages_lost/unread_for_room"] = "/".join(f"{r[k]:g}" for k in PAGE_COUNTERS)
    return out


def _summed(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pin figures over an arm's rounds: counters summed, pinned pages at each round's end."""
    names = (*PIN_COUNTERS, *(f"reloads_{o}" for o in PREFETCH_OUTCOMES), *PAGE_COUNTERS)
    out: dict[str, Any] = {name: sum(r[name] for r in rounds) for name in names}
    out["pinned_pages_end"] = [r["pinned_pages_end"] for r in rounds]
    return out


def _run_served(
    path: Path, spec: AgentSpec, arm: str, sampler: GapSampler, out_dir: Path
) -> tuple[ArmResult, dict[str, Any]]:
    from kvstrata.serve.process import ServerProcess

    store = out_dir / f"bench-agent-store-{arm}"
    _empty(store)
    args = [
        "--model", str(path), "--page-size", str(spec.page_size),
        "--device-pages", str(spec.device_pages), "--host-pages", str(spec.host_pages),
        "--storage-url", str(store), "--threads", str(BENCH_THREADS),
        "--max-pending", str(4 * spec.sessions), "--prefill-order", spec.prefill_order,
        "--storage-emulate-read-s-per-page", str(spec.storage_read_s_per_page),
        # a server sized for its store: a reload is waited for, not cut short and recomputed
        "--prefetch-timeout-per-page-s", str(READ_BUDGET_X * spec.storage_read_s_per_page),
    ]  # fmt: skip
    srv = ServerProcess(args, out_dir / f"bench-agent-{arm}.log")
    try:
        res = run_arm(srv.url, spec, arm, sampler)
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    finally:
        if srv.terminate() != 0:
            raise RuntimeError(f"server ({arm}) did not exit 0; see {srv.log}")
    return res, pin_metrics(metrics)


def _empty(store: Path) -> None:
    """A fresh storage directory: no arm reads another's pages."""
    import shutil

    if store.exists():
        shutil.rmtree(store)
    store.mkdir(parents=True)


def summarize(res: ArmResult) -> dict[str, Any]:
    in_flight = [t.in_flight for t in res.turns]
    return {
        **_group(res.turns),
        "hinted": _group([t for t in res.turns if t.hinted]),
        "unhinted": _group([t for t in res.turns if not t.hinted]),
        "hinted_returning": _group([t for t in res.turns if t.hinted and t.turn > 0]),
        "unhinted_returning": _group([t for t in res.turns if not t.hinted and t.turn > 0]),
        "requests": len(res.turns),
        "errors": len(res.errors),
        "error_messages": res.errors[:5],
        "in_flight_mean": sum(in_flight) / len(in_flight) if in_flight else 0.0,
        "in_flight_max": max(in_flight, default=0),
        "pinned_tokens_reported": sum(t.pinned_tokens for t in res.turns),
        "hints_sent": res.hints,
        "wall_s": res.wall_s,
        "turn_log": [
            _row(t) for t in sorted(res.turns, key=lambda t: (t.round, t.session, t.turn))
        ],
    }


def _row(t: Turn) -> str:
    """One turn, for reading a run: where its prompt came from and what it waited."""
    tiers = "/".join(str(t.by_tier.get(k, 0)) for k in TIERS)
    hinted = "hinted" if t.hinted else "unhinted"
    return (
        f"r{t.round} s{t.session} t{t.turn} {hinted} sent {t.sent_s:.1f}s ttft {t.ttft_s:.3f}s "
        f"prompt {t.prompt_tokens} "
        f"dev/host/storage {tiers} in_flight {t.in_flight}"
    )


TIERS = ("device", "host", "storage")


def _group(turns: list[Turn]) -> dict[str, Any]:
    """TTFT and where the prompt tokens came from, over some sessions' turns."""
    ttfts = sorted(t.ttft_s for t in turns)
    prompt = sum(t.prompt_tokens for t in turns)
    tokens = {tier: sum(t.by_tier.get(tier, 0) for t in turns) for tier in TIERS}
    tokens["computed"] = prompt - sum(tokens.values())
    # a history token computed again: lost from every tier (or in a page never full)
    tokens["history_computed"] = sum(
        max(0, t.prompt_tokens - sum(t.by_tier.get(k, 0) for k in TIERS) - t.new_tokens)
        for t in turns
    )
    return {
        "turns": len(turns),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p90_s": _pct(ttfts, 0.9),
        "prompt_tokens_from": tokens,
        "hit_rate": sum(tokens[k] for k in TIERS) / prompt if prompt else 0.0,
        "hit_rate_by_tier": {k: tokens[k] / prompt if prompt else 0.0 for k in TIERS},
    }


PIN_COUNTERS = ("pins_made", "pins_expired", "pins_dropped_for_budget", "pins_refused_for_budget")
PREFETCH_OUTCOMES = ("complete", "partial", "empty", "stopped")  # kvstrata:prefetch_total
PAGE_COUNTERS = ("lost_pages", "prefetch_no_room_pages")


def pin_metrics(text: str) -> dict[str, Any]:
    """The server's pin figures from /metrics: counters, and pages pinned per tier at the end;
    and its storage reloads' outcomes."""
    out: dict[str, Any] = {}
    for name in PIN_COUNTERS:
        out[name] = _sample(text, f"{name}_total") or 0.0
    for outcome in PREFETCH_OUTCOMES:  # storage reloads (stopped: cut short)
        out[f"reloads_{outcome}"] = _required(text, "prefetch_total", f'outcome="{outcome}"')
    for name in PAGE_COUNTERS:  # what pressure on the pools cost: pages computed again
        out[name] = _required(text, f"{name}_total")
    out["pinned_pages_end"] = {
        tier: float(v)
        for tier, v in re.findall(
            r'^kvstrata:pinned_pages\{[^}]*tier="(\w+)"[^}]*\} (\S+)$', text, re.M
        )
    }
    return out


def _sample(text: str, family: str, label: str = "") -> float | None:
    """The value of `kvstrata:<family>`'s sample in /metrics text (the one with `label`)."""
    found = re.search(rf"^kvstrata:{family}\{{[^}}]*{label}[^}}]*\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def _required(text: str, family: str, label: str = "") -> float:
    """A sample the server always exports (zeros too): its absence is a broken parse."""
    found = _sample(text, family, label)
    if found is None:
        raise RuntimeError(f"/metrics has no kvstrata:{family} sample {label}".rstrip())
    return found


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")

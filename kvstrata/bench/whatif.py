"""The what-if study behind `kvstrata simulate`: one topology in detail, plus an ablation table.

Ablation rows are cache configurations (off, device, device+host, device+host+storage), each
replayed once through the real cache; columns are topologies. Capacities are the same in every
column (those of the main topology unless given), so along a row only parallelism changes and down a
column only the cache does: the table separates the gain of cache reuse from that of the parallel
layout and the storage tier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvstrata.bench.costmodel import CostModel, Topology
from kvstrata.bench.hardware import HardwareProfile, ModelSpec
from kvstrata.bench.replay import ReplayConfig, replay
from kvstrata.bench.simulate import Outcome, Timing, fifo, no_cache, summarize
from kvstrata.workloads.trace import Trace

ROWS: tuple[str, ...] = ("off", "device", "device+host", "device+host+storage")


def row_config(row: str, base: ReplayConfig) -> ReplayConfig | None:
    """The replay config of one ablation row (None: cache off, nothing to replay)."""
    c = base.cache
    if row == "off":
        return None
    if row == "device":
        return dataclasses.replace(base, cache=dataclasses.replace(c, host_pages=0, storage_url=""))
    if row == "device+host":
        return dataclasses.replace(base, cache=dataclasses.replace(c, storage_url=""))
    if row == "device+host+storage":
        return dataclasses.replace(
            base, cache=dataclasses.replace(c, storage_url=c.storage_url or "mem://")
        )
    raise ValueError(f"unknown ablation row {row!r}; known: {', '.join(ROWS)}")


def default_topologies(main: Topology, model: ModelSpec) -> list[Topology]:
    """tp1, the main layout, and the main layout with P/D flipped: those that fit the model."""
    flipped = dataclasses.replace(main, pd=not main.pd)
    out: list[Topology] = []
    for t in (Topology(), dataclasses.replace(main, pd=False), main, flipped):
        try:
            t.check(model)
        except ValueError:
            continue
        if t not in out:
            out.append(t)
    return out


def with_capacities(
    base: ReplayConfig, cost: CostModel, device_tokens: int | None, host_tokens: int | None
) -> ReplayConfig:
    """Fill unset capacities (tokens) from what the main topology's HBM and host DRAM hold."""
    hbm, dram = cost.capacity_tokens()
    page = base.page_size
    device = (hbm if device_tokens is None else device_tokens) // page
    host = (dram if host_tokens is None else host_tokens) // page
    c = base.cache
    cache = dataclasses.replace(
        c, device_pages=device, host_pages=host, storage_url=c.storage_url if host else ""
    )
    return dataclasses.replace(base, cache=cache)


def whatif(
    trace: Trace,
    model: ModelSpec,
    hw: HardwareProfile,
    main: Topology,
    base: ReplayConfig,
    topologies: Sequence[Topology] | None = None,
    time_scale: float = 1.0,
    progress: Callable[[str, int], None] | None = None,
) -> tuple[dict[str, Any], list[Timing]]:
    """Report (JSON-ready) and the per-request timings of the main row/topology
    (device+host+storage)."""
    main_cost = CostModel(model, hw, main)  # validates the main topology first
    tops = list(topologies) if topologies else default_topologies(main, model)
    costs = {t.label: CostModel(model, hw, t) for t in tops}
    costs.setdefault(main.label, main_cost)
    outcomes, replays = _replay_rows(trace, base, progress)
    ablation = {
        row: {label: _cell(fifo(outcomes[row], c, time_scale)) for label, c in costs.items()}
        for row in ROWS
    }
    main_timings = fifo(outcomes["device+host+storage"], main_cost, time_scale)
    top = replays["device+host+storage"]
    report: dict[str, Any] = {
        "trace": trace.source,
        "hardware": hw.name,
        "model": model.name,
        "topology": main.label,
        "time_scale": time_scale,
        "capacity_tokens": _capacity(base),
        **summarize(main_timings),
        **_pd_figures(outcomes["device+host+storage"], main_cost, main_timings),
        "hit_rate": top["hit_rate"],
        "hit_rate_by_tier": top["hit_rate_by_tier"],
        "ceiling": top["ceiling"],
        "ablation": ablation,
        "replays": {r: {k: v[k] for k in REPLAY_KEYS} for r, v in replays.items()},
    }
    return report, main_timings


REPLAY_KEYS = ("hit_rate", "hit_rate_by_tier", "bytes_moved", "wall_s")


def _capacity(base: ReplayConfig) -> dict[str, Any]:
    """Tokens each tier holds (storage: unbounded)."""
    page = base.page_size
    return {
        "device": base.cache.device_pages * page,
        "host": base.cache.host_pages * page,
        "storage": "unbounded",
    }


def _replay_rows(
    trace: Trace, base: ReplayConfig, progress: Callable[[str, int], None] | None
) -> tuple[dict[str, list[Outcome]], dict[str, dict[str, Any]]]:
    """Replay the trace once per cache row; the "off" row is the device row's requests with no
    hits."""
    outcomes: dict[str, list[Outcome]] = {}
    replays: dict[str, dict[str, Any]] = {}
    for row in ROWS:
        cfg = row_config(row, base)
        if cfg is None:
            continue
        cb = (lambda n, r=row: progress(r, n)) if progress else None
        res = replay(trace, cfg, cb)
        outcomes[row] = res.outcomes
        replays[row] = res.report()
    outcomes["off"] = no_cache(outcomes["device"])
    return outcomes, replays


def _cell(timings: list[Timing]) -> dict[str, Any]:
    s = summarize(timings)
    keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "decomposition")
    return {k: s[k] for k in (*keys, "pd_bytes_sent")}


def _pd_figures(outcomes: list[Outcome], cost: CostModel, timings: list[Timing]) -> dict:
    """P/D: bytes sent against sending every prompt whole (a decode worker holding nothing)."""
    if not cost.topo.pd:
        return {}
    whole = float(sum(o.prompt for o in outcomes) * cost.kv_per_token)
    sent = float(sum(t.pd_bytes for t in timings))
    return {"pd_bytes_whole_prompts": whole, "pd_bytes_sent_ratio": sent / whole if whole else 0.0}

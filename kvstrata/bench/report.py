"""Report output shared by `kvstrata replay` and `kvstrata simulate`: JSON, tables, the PNG."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from kvstrata.bench.simulate import TERMS, Outcome


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))


def hit_rate_png(outcomes: Sequence[Outcome], path: Path, bins: int = 40, title: str = "") -> None:
    """Hit rate over time (by arrival), stacked by tier: hit tokens / prompt tokens per bin."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    t = np.array([o.arrival_s for o in outcomes])
    edges = np.linspace(t.min(), t.max() + 1e-9, bins + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    prompt = np.bincount(idx, weights=[o.prompt for o in outcomes], minlength=bins)
    denom = np.where(prompt > 0, prompt, 1)
    layers = [
        np.bincount(idx, weights=[getattr(o, k) for o in outcomes], minlength=bins) / denom
        for k in ("device", "host", "storage")
    ]
    mid = (edges[:-1] + edges[1:]) / 2
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.stackplot(mid, *layers, labels=["device", "host", "storage"], alpha=0.85)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("hit rate (tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(title or "prefix-cache hit rate over time")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def replay_table(rep: dict[str, Any]) -> Table:
    table = Table(title=f"kvstrata replay ({rep['tiers']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests", str(rep["requests"]))
    table.add_row("prompt tokens", f"{rep['prompt_tokens']:,}")
    table.add_row("hit rate", f"{rep['hit_rate']:.4f}")
    for tier, v in rep["hit_rate_by_tier"].items():
        table.add_row(f"  from {tier}", f"{v:.4f}")
    table.add_row("ceiling (infinite capacity)", f"{rep['ceiling']:.4f}")
    for d, n in rep["bytes_moved"].items():
        table.add_row(f"bytes {d}", f"{n:,}")
    for tier, n in rep["evictions"].items():
        table.add_row(f"evicted pages {tier}", f"{n:,}")
    table.add_row("cache work (tokens/s)", f"{rep['tokens_per_s']:,.0f}")
    return table


def ablation_table(rep: dict[str, Any]) -> Table:
    ablation = rep["ablation"]
    tops = list(next(iter(ablation.values())))
    table = Table(title="TTFT p50 / mean (s): cache configuration x topology")
    table.add_column("cache")
    for t in tops:
        table.add_column(t, justify="right")
    for row, cells in ablation.items():
        table.add_row(
            row, *(f"{cells[t]['ttft_p50_s']:.3f} / {cells[t]['ttft_mean_s']:.3f}" for t in tops)
        )
    return table


def decomposition_table(rep: dict[str, Any]) -> Table:
    table = Table(title=f"TTFT {rep['topology']} on {rep['hardware']} ({rep['model']})")
    table.add_column("metric")
    table.add_column("seconds", justify="right")
    for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s"):
        table.add_row(k, f"{rep[k]:.4f}")
    for k in TERMS:
        table.add_row(f"  mean {k}", f"{rep['decomposition'][k]:.4f}")
    return table


def fleet_table(rep: dict[str, Any]) -> Table:
    """`simulate --replicas`: one row per (N, arm)."""
    table = Table(title=f"fleet on paper: {rep['trace']}")
    for col in ("replicas", "routing", "hit rate", "device", "host", "storage", "ceiling"):
        table.add_column(col, justify="right")
    for col in ("hit/ceiling", "TTFT p50", "TTFT p90", "busiest/mean"):
        table.add_column(col, justify="right")
    for r in rep["rows"]:
        tiers = [f"{r['hit_rate_by_tier'][t]:.1%}" for t in ("device", "host", "storage")]
        table.add_row(
            str(r["replicas"]), r["routing"], f"{r['hit_rate']:.1%}", *tiers,
            f"{r['ceiling']:.1%}", f"{r['hit_over_ceiling']:.3f}", f"{r['ttft_p50_s']:.3f}s",
            f"{r['ttft_p90_s']:.3f}s", f"{r['busiest_over_mean']:.2f}",
        )  # fmt: skip
    return table

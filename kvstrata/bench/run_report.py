"""The report of `kvstrata run`: per-configuration figures, the JSON file and the TTFT plot.

JSON shape (docs/CONTRACTS.md):
    {"configs": {name: {"hit_rate", "hit_rate_by_tier": {"device","host","storage"}, "ttft_p50_s",
                        "ttft_p90_s", "bytes_moved": {direction: bytes},
                        "spec": None | {"acceptance_rate", "accept_length", ...},
                        "requests": [{..., "spec": None | {..., "accepts": [...]}}]}},
     "outputs_identical": bool, ...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.cache.counters import DIRECTIONS, TIERS
from kvstrata.cache.lease import hittable_pages
from kvstrata.engine.request import Request


@dataclass(frozen=True)
class TurnResult:
    """One finished request of the workload, with its place in the workload."""

    session: int
    turn: int
    rid: str
    prompt_tokens: int
    output: list[int]
    hits: dict[str, int]  # prompt pages by tier: device, host, storage
    ttft_s: float
    page_size: int
    spec_accepts: tuple[int, ...] = ()  # accepted drafts per verify step (speculation only)
    spec_proposed: int = 0

    @classmethod
    def of(cls, session: int, turn: int, req: Request, page_size: int) -> TurnResult:
        return cls(
            session,
            turn,
            req.rid,
            len(req.tokens),
            list(req.output),
            req.hits,
            req.ttft_s,
            page_size,
            tuple(req.spec_accepts),
            req.spec_proposed,
        )

    @property
    def prompt_pages(self) -> int:
        return hittable_pages(self.prompt_tokens, self.page_size)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "session": self.session,
            "turn": self.turn,
            "prompt_tokens": self.prompt_tokens,
            "prompt_pages": self.prompt_pages,
            "hits": dict(self.hits),
            "ttft_s": self.ttft_s,
            "output": list(self.output),
            "spec": spec_figures([self]),
        }


def spec_figures(results: list[TurnResult]) -> dict[str, Any] | None:
    """Acceptance rate and mean accepted length (tokens per verify step) of `results`;
    None when none of them ran speculative decoding."""
    steps = [a for t in results for a in t.spec_accepts]
    proposed = sum(t.spec_proposed for t in results)
    if not steps:
        return None
    return {
        "verify_steps": len(steps),
        "proposed": proposed,
        "accepted": sum(steps),
        "acceptance_rate": sum(steps) / proposed if proposed else 0.0,
        "accept_length": (sum(steps) + len(steps)) / len(steps),
        "accepts": steps,
    }


def config_report(results: list[TurnResult], counters: dict[str, Any] | None) -> dict[str, Any]:
    """Figures of one configuration; `counters` is the cache's as_dict() (None: cache off)."""
    pages = sum(t.prompt_pages for t in results) or 1
    hits = {tier: sum(t.hits[tier] for t in results) for tier in TIERS}
    ttfts = np.array([t.ttft_s for t in results], dtype=np.float64)
    bytes_moved = (
        dict(counters["bytes_moved"]) if counters else dict.fromkeys(DIRECTIONS.values(), 0)
    )
    ordered = sorted(results, key=lambda t: (t.session, t.turn))
    return {
        "hit_rate": sum(hits.values()) / pages,
        "hit_rate_by_tier": {tier: n / pages for tier, n in hits.items()},
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p90_s": float(np.percentile(ttfts, 90)),
        "ttft_mean_s": float(ttfts.mean()),
        "bytes_moved": bytes_moved,
        "prompt_pages": pages,
        "cache_counters": counters,
        "spec": _overall(spec_figures(results)),
        "requests": [t.as_dict() for t in ordered],
    }


def _overall(figures: dict[str, Any] | None) -> dict[str, Any] | None:
    """A configuration's spec figures without the per-step list (each request keeps its own)."""
    return None if figures is None else {k: v for k, v in figures.items() if k != "accepts"}


def outputs_identical(configs: dict[str, list[TurnResult]]) -> bool:
    """True when every configuration generated the same tokens for every request."""
    per_config = [{t.rid: t.output for t in res} for res in configs.values()]
    return all(p == per_config[0] for p in per_config[1:])


def ttft_by_turn(report: dict[str, Any]) -> list[float]:
    """Mean TTFT of each turn index across sessions, for one configuration's report."""
    by_turn: dict[int, list[float]] = {}
    for r in report["requests"]:
        by_turn.setdefault(r["turn"], []).append(r["ttft_s"])
    return [float(np.mean(by_turn[k])) for k in sorted(by_turn)]


def write_plot(configs: dict[str, dict[str, Any]], path: Path) -> Path:
    """PNG: mean TTFT per turn, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rep in configs.items():
        ys = ttft_by_turn(rep)
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (s), mean over sessions")
    ax.set_title("kvstrata run: time to first token per turn")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write report.json and ttft.png into out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=2))
    return json_path, write_plot(report["configs"], out_dir / "ttft.png")

"""The figures of `kvstrata bench fleet`: per arm from its answered turns and the processes'
/metrics, the run's headline ratios, the table and the PNG.

Per arm: hit rate by tier (the replicas' `cached_tokens_by_tier` over prompt tokens) against the
trace's ceiling (a cache that never evicts, shared by all, fed the prompts in send order: the
full pages of each prompt seen before, within its hittable pages), TTFT p50/p90, output tokens
per second of wall time, the busiest replica's requests over the mean (each replica's finished
requests, from its own /metrics), and the share of requests whose cached tokens the router
predicted exactly (its `cached_tokens_predictions` counter; None where it keeps none).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

from kvstrata.bench.fleet_load import Slot
from kvstrata.bench.pd_load import Prompts, Turn, percentile
from kvstrata.bench.reference import ceiling
from kvstrata.cache.keys import Namespace, page_keys

TIERS = ("device", "host", "storage")
FINISHED = "kvstrata:request_success_total"
PREDICTIONS = "kvstrata:router_cached_tokens_predictions_total"


def ceiling_share(prompts: Prompts, slots: Sequence[Slot], page: int) -> float:
    """Hit tokens / prompt tokens of an infinite cache fed the prompts in slot order."""
    ns = Namespace(page_size=page)
    pairs = []
    for slot in slots:
        prompt = prompts[slot.session][slot.turn]
        keys = page_keys(prompt, ns)
        pairs.append((keys[: (len(prompt) - 1) // page], keys))
    total = sum(len(prompts[x.session][x.turn]) for x in slots)
    return sum(ceiling(pairs)) * page / total


def metric_sum(text: str, sample: str, **labels: str) -> float | None:
    """Sum of the samples named `sample` whose labels include `labels`; None if there is none."""
    found = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return float(sum(found)) if found else None


def arm_figures(
    turns: Sequence[Turn],
    wall_s: float,
    per_replica: Sequence[int],
    router_metrics: str,
    ceil: float,
) -> dict[str, Any]:
    prompt = sum(t.prompt_tokens for t in turns)
    by_tier = {tier: sum(_by_tier(t).get(tier, 0) for t in turns) / prompt for tier in TIERS}
    hit = sum(by_tier.values())
    equal = metric_sum(router_metrics, PREDICTIONS, outcome="equal")
    unequal = metric_sum(router_metrics, PREDICTIONS, outcome="unequal") or 0.0
    predicted = equal / (equal + unequal) if equal is not None and equal + unequal else None
    mean = sum(per_replica) / len(per_replica)
    return {
        "requests": len(turns),
        "hit_rate": hit,
        "hit_rate_by_tier": by_tier,
        "ceiling": ceil,
        "hit_over_ceiling": hit / ceil if ceil else 0.0,
        "ttft_p50_s": percentile([t.ttft_s for t in turns], 0.5),
        "ttft_p90_s": percentile([t.ttft_s for t in turns], 0.9),
        "output_tokens_per_s": sum(_completion(t) for t in turns) / wall_s,
        "requests_per_replica": list(per_replica),
        "busiest_over_mean": max(per_replica) / mean if mean else 0.0,
        "predicted_equals_reported": predicted,
        "wall_s": wall_s,
    }


def _by_tier(t: Turn) -> dict[str, int]:
    details = t.usage.get("prompt_tokens_details") or {}
    return dict(details.get("cached_tokens_by_tier") or {})


def _completion(t: Turn) -> int:
    return int(t.usage.get("completion_tokens") or 0)


def headline(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The four goals' figures (None where an arm they need did not run)."""
    kv, rr = arms.get("kv_aware"), arms.get("rr_shared")
    return {
        "hit_over_ceiling_kv_aware": kv["hit_over_ceiling"] if kv else None,
        "ttft_p50_kv_aware_over_rr_shared": kv["ttft_p50_s"] / rr["ttft_p50_s"]
        if kv and rr and rr["ttft_p50_s"]
        else None,
        "busiest_over_mean_kv_aware": kv["busiest_over_mean"] if kv else None,
        "predicted_equals_reported_kv_aware": kv["predicted_equals_reported"] if kv else None,
    }


def fleet_table(arms: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="kvstrata bench fleet: one run per arm")
    cols = ("arm", "hit rate", "device", "host", "storage", "hit/ceiling", "TTFT p50", "TTFT p90")
    for col in (*cols, "out tok/s", "busiest/mean", "predicted=reported"):
        table.add_column(col, justify="right")
    for name, a in arms.items():
        tiers = [f"{a['hit_rate_by_tier'][t]:.1%}" for t in TIERS]
        pred = a["predicted_equals_reported"]
        table.add_row(
            name, f"{a['hit_rate']:.1%}", *tiers, f"{a['hit_over_ceiling']:.3f}",
            f"{a['ttft_p50_s']:.3f}s", f"{a['ttft_p90_s']:.3f}s", f"{a['output_tokens_per_s']:.1f}",
            f"{a['busiest_over_mean']:.2f}", "-" if pred is None else f"{pred:.1%}",
        )  # fmt: skip
    return table


def fleet_png(arms: dict[str, dict[str, Any]], ceil: float, path: Path) -> None:
    """Left: hit rate by tier per arm, the ceiling as a line; right: TTFT p50 and p90 per arm."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    names = list(arms)
    x = range(len(names))
    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    bottom = [0.0] * len(names)
    for tier in TIERS:
        vals = [arms[n]["hit_rate_by_tier"][tier] for n in names]
        hits.bar(x, vals, bottom=bottom, label=tier)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    hits.axhline(ceil, color="black", linestyle="--", label="ceiling")
    hits.set_xticks(list(x), names)
    hits.set_ylim(0, 1)  # the ceiling line stays visible above the bars
    hits.set_ylabel("hit rate (prompt tokens)")
    hits.legend(loc="upper left")
    width = 0.4
    ttft.bar([i - width / 2 for i in x], [arms[n]["ttft_p50_s"] for n in names], width, label="p50")
    ttft.bar([i + width / 2 for i in x], [arms[n]["ttft_p90_s"] for n in names], width, label="p90")
    ttft.set_xticks(list(x), names)
    ttft.set_ylabel("TTFT (s)")
    ttft.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

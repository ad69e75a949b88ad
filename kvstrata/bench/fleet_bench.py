"""`kvstrata bench fleet`: N local replicas behind the fleet router, one shared store, agent
sessions at a fixed arrival rate; one run per arm, each on fresh replicas and a fresh store:

    rr_local   round robin, no shared store (each replica has only its device and host memory)
    rr_shared  round robin + the shared store
    kv_aware   the router's kv_aware routing + the shared store
    dynamo     kv_aware scored by Dynamo's standalone indexer + the shared store (only where
               .venv-dynamo holds it: scripts/setup_dynamo.sh)

Replicas get small device and host pools (device ~1.5 sessions' pages, host about the sessions a
replica would keep under kv_aware) so sessions compete for them. The store is a file directory by
default; `--storage-url mooncake` starts a local Mooncake master + holder per arm, and a
`mooncake://` URL is used as given (each arm under its own key prefix). The prompts are the
agent workload's token ids (kvstrata/workloads/agent.py; plain text turns for a checkpoint with
no chat template). Figures: kvstrata/bench/fleet_figures.py.
"""

from __future__ import annotations

import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstrata.bench.fleet_figures import (
    FINISHED,
    arm_figures,
    ceiling_share,
    fleet_png,
    fleet_table,
    headline,
    metric_sum,
)
from kvstrata.bench.fleet_load import drive_at_rate, schedule
from kvstrata.bench.pd import workload
from kvstrata.bench.pd_load import Prompts, pages
from kvstrata.bench.registry import BENCHES
from kvstrata.workloads.agent import WorkloadSpec

# Sessions not a multiple of the default 3 replicas: else round robin's turn-major cycle would
# land every turn of a session on one replica (session-sticky by accident).
QUICK = WorkloadSpec(sessions=5, turns=3, first_lines=12, tool_lines=6, max_new_tokens=8)
FULL = WorkloadSpec(sessions=13, turns=5, first_lines=40, tool_lines=16, max_new_tokens=16)
RATE = {True: 1.0, False: 0.5}
"""Requests per second, quick and full."""
PAGE = 16
REPLICAS = 3


@dataclass(frozen=True)
class Arm:
    name: str
    routing: str
    shared_store: bool
    indexer: bool = False


ARMS = (
    Arm("rr_local", "round_robin", shared_store=False),
    Arm("rr_shared", "round_robin", shared_store=True),
    Arm("kv_aware", "kv_aware", shared_store=True),
    Arm("dynamo", "kv_aware", shared_store=True, indexer=True),
)


@dataclass(frozen=True)
class FleetRun:
    """What every arm shares."""

    model: str
    prompts: Prompts
    spec: WorkloadSpec
    replicas: int
    rate: float
    store: str  # "file", "mooncake" or a mooncake:// URL
    out_dir: Path


def pool_args(prompts: Prompts, max_new: int, replicas: int) -> list[str]:
    """Small pools: device ~1.5 sessions' final pages, host the rest of the sessions a replica
    keeps when each session stays on one replica, so round robin (every replica sees every
    session) spills and kv_aware fits."""
    final = [pages(len(s[-1]) + max_new, PAGE) for s in prompts]
    mean = sum(final) / len(final)
    device = max(max(final) + 1, int(1.5 * mean))
    per_replica = -(-len(prompts) // replicas)
    host = max(device, int((per_replica + 0.5) * mean))
    return [
        "--page-size", str(PAGE), "--device-pages", str(device), "--host-pages", str(host),
        "--prefetch-policy", "wait_complete",
    ]  # fmt: skip


def check_store(url: str | None) -> str:
    """--storage-url: none (a file store), 'mooncake', or a mooncake:// URL."""
    if url in (None, "", "file"):
        return "file"
    if url == "mooncake" or url.startswith("mooncake://"):
        return url
    raise ValueError(
        f"--storage-url: 'mooncake' or a mooncake:// URL (default: a file store), got {url!r}"
    )


def arm_store(run: FleetRun, arm: Arm, tmp: str) -> str:
    """The arm's LocalFleet store: '' (none), 'mooncake' (started with it) or a fresh URL."""
    from kvstrata.storage.mooncake_url import mooncake_sibling_url

    if not arm.shared_store:
        return ""
    if run.store == "file":
        return f"file://{tmp}/{arm.name}-store"
    if run.store == "mooncake":
        return "mooncake"
    return mooncake_sibling_url(run.store, f"{arm.name}-{uuid.uuid4().hex[:8]}:")


def run_arm(run: FleetRun, arm: Arm, ceil: float, tmp: str) -> dict[str, Any]:
    """Start the arm's fleet (and indexer), drive the trace through its router, stop it all."""
    import httpx2 as httpx

    from kvstrata.bench.dynamo_indexer import DynamoIndexerProcess
    from kvstrata.bench.local_fleet import LocalFleet, LocalFleetConfig

    logs = run.out_dir / "bench-fleet-logs" / arm.name
    logs.mkdir(parents=True, exist_ok=True)
    indexer = DynamoIndexerProcess(logs / "indexer.log").start() if arm.indexer else None
    cfg = LocalFleetConfig(
        model=run.model, replicas=run.replicas, store=arm_store(run, arm, tmp),
        log_dir=str(logs), routing=arm.routing, indexer_url=indexer.url if indexer else "",
        replica_args=tuple(pool_args(run.prompts, run.spec.max_new_tokens, run.replicas)),
    )  # fmt: skip
    fleet = LocalFleet(cfg)
    try:
        fleet.start()
        turns, wall = drive_at_rate(fleet.url, run.prompts, run.spec.max_new_tokens, run.rate)
        per_replica = [
            _finished(httpx.get(f"{r.url}/metrics", timeout=30).text) for r in fleet.replicas
        ]
        router = httpx.get(f"{fleet.url}/metrics", timeout=30).text
    finally:
        codes = fleet.stop()
        if indexer is not None:
            indexer.stop()
    if any(codes.values()):
        raise RuntimeError(
            f"bench fleet {arm.name}: processes did not exit 0: {codes}; logs in {logs}"
        )
    out = arm_figures(turns, wall, per_replica, router, ceil)
    out["texts"] = [t.text for t in sorted(turns, key=lambda t: (t.session, t.turn))]
    return out


def _finished(metrics: str) -> int:
    return int(metric_sum(metrics, FINISHED) or 0)


@BENCHES.register("fleet")
def fleet_bench(
    quick: bool,
    model: str | None = None,
    out: Path | None = None,
    sessions: int | None = None,
    replicas: int | None = None,
    storage_url: str | None = None,
    rate: float | None = None,
) -> dict[str, Any]:
    from kvstrata.bench.dynamo_indexer import dynamo_missing
    from kvstrata.engine.build import resolve_model_path
    from kvstrata.engine.config import EngineConfig

    store = check_store(storage_url)
    if replicas is not None and replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    base = QUICK if quick else FULL
    spec = WorkloadSpec(**{**base.__dict__, "sessions": sessions or base.sessions})
    path = resolve_model_path(EngineConfig(model=model or ""))
    run = FleetRun(
        str(path), workload(path, spec), spec, replicas or REPLICAS, rate or RATE[quick], store,
        out or Path("kvstrata-out"),
    )  # fmt: skip
    ceil = ceiling_share(run.prompts, schedule(run.prompts, run.rate), PAGE)
    skipped = {"dynamo": why} if (why := dynamo_missing()) else {}
    arms: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-fleet-") as tmp:
        for arm in ARMS:
            if arm.name not in skipped:
                arms[arm.name] = run_arm(run, arm, ceil, tmp)
    return _report(run, arms, skipped, ceil)


def _report(
    run: FleetRun, arms: dict[str, dict[str, Any]], skipped: dict[str, str], ceil: float
) -> dict[str, Any]:
    texts = {name: a.pop("texts") for name, a in arms.items()}
    Console().print(fleet_table(arms))
    png = run.out_dir / "fleet.png"
    fleet_png(arms, ceil, png)
    return {
        **headline(arms),
        "ceiling": ceil,
        "outputs_identical": len({tuple(t) for t in texts.values()}) == 1,
        "arms_run": list(arms),
        "arms_skipped": skipped,
        "arms": arms,
        "model": run.model,
        "replicas": run.replicas,
        "rate_per_s": run.rate,
        "store": run.store,
        "workload": run.spec.__dict__,
        "page_size": PAGE,
        "png": str(png),
    }

"""P/D on the HTTP side: GET /v1/pd/info and the `kvstrata:pd_*` Prometheus counters."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter


class PDMetrics:
    """Counters of hand-offs (thread-safe: bumped on the engine and listener threads)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        lbl, self.name = ["model_name"], model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"kvstrata:{name}", doc, [*lbl, *extra], registry=registry)

        self.pages = counter("pd_pages", "KV pages of P/D hand-offs", ("direction",))
        self.bytes = counter("pd_bytes", "KV bytes of P/D hand-offs", ("direction",))
        self.skipped = counter("pd_pages_skipped", "prompt pages decode held: not sent")
        self.storage = counter("pd_pages_from_storage", "held pages decode took from L3")
        self.computed = counter("pd_prefill_computed_tokens", "prompt tokens prefill computed")
        self.handoffs = counter("pd_handoffs", "hand-offs by outcome", ("outcome",))

    def sent(self, pages: int, nbytes: int) -> None:
        self.pages.labels(self.name, "sent").inc(pages)
        self.bytes.labels(self.name, "sent").inc(nbytes)
        self.handoffs.labels(self.name, "ok").inc()

    def received(self, usage: dict[str, Any], part_bytes: int = 0) -> None:
        """usage: the request's usage.pd (whole pages); part_bytes: this rank's bytes (unused)."""
        self.pages.labels(self.name, "received").inc(usage["pages_received"])
        self.bytes.labels(self.name, "received").inc(usage["bytes_received"])
        self.skipped.labels(self.name).inc(usage["pages_skipped"])
        self.storage.labels(self.name).inc(usage["pages_from_storage"])
        self.computed.labels(self.name).inc(usage["prefill_computed_tokens"])
        self.handoffs.labels(self.name, "ok").inc()

    def pulled(self, direction: str, pages: int, nbytes: int) -> None:
        """Held pages prefill pulled from decode: "pull_sent" on decode (every page it sent),
        "pull_received" on prefill (the pages that passed their checksums and were used)."""
        self.pages.labels(self.name, direction).inc(pages)
        self.bytes.labels(self.name, direction).inc(nbytes)

    def failed(self) -> None:
        self.handoffs.labels(self.name, "failed").inc()

    def retried(self) -> None:
        """A reply failed its checks (e.g. a page checksum) and the hand-off was asked again."""
        self.handoffs.labels(self.name, "retried").inc()


def add_routes(app: FastAPI, state: Any) -> None:
    """GET /v1/pd/info on every role (a single server answers role "single")."""

    @app.get("/v1/pd/info")
    async def pd_info() -> dict[str, Any]:
        state.check_ready()
        if state.pd is not None:
            return state.pd.info()
        engine = state.loop.engine if hasattr(state.loop, "built") and state.loop.built else None
        from kvstrata.pd.worker import layout_of  # avoids a cycle at import

        return {
            "role": "single",
            "transport": "",
            "transfer_endpoint": "",
            "transfer_endpoints": [],
            "prefill": [],
            "layout": layout_of(engine).as_dict() if engine is not None else None,
        }

    @app.get("/v1/pd/ranks")
    async def pd_ranks() -> dict[str, Any]:
        """A P/D worker on several ranks: each rank's part of a page and its own counters
        (measured on that rank: pages and bytes it sent or received). [] on one rank."""
        state.check_ready()
        if state.pd is None or not state.pd.ranked:
            return {"ranks": []}
        from kvstrata.pd.ranks import rank_stats

        fut = state.loop.call(rank_stats, every_rank=True)
        return {"ranks": await asyncio.wait_for(asyncio.wrap_future(fut), 60.0)}

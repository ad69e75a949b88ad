"""A P/D worker inside `kvstrata serve`: its side of the hand-off, wired to the engine loop."""

from __future__ import annotations

import sys
from typing import Any

from kvstrata.engine.engine import Engine
from kvstrata.listeners import Listeners
from kvstrata.pd.config import PDConfig
from kvstrata.pd.connectors import pd_side
from kvstrata.pd.decode import DecodeSide
from kvstrata.pd.layout import layout_of
from kvstrata.pd.metrics import PDMetrics
from kvstrata.pd.prefill import PrefillSide
from kvstrata.pd.transport import curve_keys, transport_of
from kvstrata.pd.wire import Layout


class PDWorker:
    """role "prefill" (listens) or "decode" (asks); `attach` runs once the engine is built.

    ranked: the worker runs on several ranks (kvstrata/pd/ranks.py): each rank has its own
    side and channel; this object (HTTP process) only picks prefill workers, serves
    /v1/pd/info (`ranked_ready`) and counts what rank 0 reports."""

    def __init__(
        self,
        role: str,
        cfg: PDConfig,
        metrics: PDMetrics,
        ranked: bool = False,
        listeners: Listeners | None = None,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"a P/D worker is a prefill or a decode, not {role!r}")
        self.role, self.cfg, self.metrics, self.ranked = role, cfg, metrics, ranked
        self.curve = curve_keys(cfg)  # its public half goes in /v1/pd/info
        if cfg.pd_insecure:
            print(
                f"kvstrata serve: WARNING: --pd-insecure: this {role} worker's KV transfer is "
                "not authenticated; any process that reaches it can exchange KV pages with it",
                file=sys.stderr,
                flush=True,
            )
        transport = None if ranked else transport_of(cfg, self.curve)
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        if transport is not None:  # prefill binds now: its endpoint is known before the engine
            side = pd_side(role, cfg, transport, metrics)
            self.prefill = side if isinstance(side, PrefillSide) else None
            self.decode = side if isinstance(side, DecodeSide) else None
            if self.prefill is not None and listeners is not None:
                self.prefill.listeners = listeners
        elif role == "decode":
            self.decode = DecodeSide(cfg, transport, metrics)  # ranked: only `choose` is used
        self.layout: Layout | None = None
        self.endpoints: list[str] = []  # ranked prefill: every rank's transfer endpoint

    @property
    def transfer_endpoint(self) -> str:
        if self.endpoints:
            return self.endpoints[0]
        return self.prefill.listener.endpoint if self.prefill is not None else ""

    def ranked_ready(self, layout: dict[str, Any], endpoints: list[str]) -> None:
        """Rank 0's report once every rank is up: the worker's layout and ranks' endpoints."""
        self.layout = Layout(**layout)
        self.endpoints = list(endpoints) if self.role == "prefill" else []

    def attach(self, loop: Any, engine: Engine) -> None:
        """On the engine thread, once built: the layout, and the side's hooks/threads."""
        self.layout = layout_of(engine)
        if self.prefill is not None:  # hand-offs go through the loop's inbox, as under ranks
            self.prefill.attach(engine, self.layout, loop.inbox)
            loop.side = self.prefill
        if self.decode is not None:
            self.decode.attach(engine, self.layout)

    def info(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "transport": self.cfg.pd_transport,
            "transfer_endpoint": self.transfer_endpoint,
            # one per rank (rank order); rank r of a decode worker talks to rank r
            "transfer_endpoints": list(self.endpoints)
            or [e for e in [self.transfer_endpoint] if e],
            "prefill": self.cfg.prefill_urls if self.role == "decode" else [],
            # the listener's CURVE public key (z85): decode talks to it only if it is one of
            # its own --pd-curve-peers-dir keys ("": no CURVE)
            "curve_public_key": self.curve.public.decode() if self.curve is not None else "",
            "layout": self.layout.as_dict() if self.layout is not None else None,
        }

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()

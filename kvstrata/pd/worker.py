"""A P/D worker's HTTP side inside `kvstrata serve`, on one rank and on many alike.

Its ranks' sides (kvstrata/pd/ranks.py: RankPD, one per rank) own the connectors and the
transfer channels; this side only picks each new request's prefill worker (decode), serves
/v1/pd/info from what the ranks report once up (`report`: SideUp) and counts their hand-offs
(`report`: the counter events, into the worker's Prometheus counters).
"""

from __future__ import annotations

import sys
from typing import Any

from kvstrata.pd.config import PDConfig
from kvstrata.pd.decode import Resolver, prefill_auth
from kvstrata.pd.metrics import PDMetrics
from kvstrata.pd.prefill_set import PrefillPicker, PrefillSet
from kvstrata.pd.reports import PDReport, SideUp
from kvstrata.pd.transport import curve_keys
from kvstrata.pd.wire import Layout


class PDWorker:
    """role "prefill" (its ranks listen) or "decode" (its ranks ask)."""

    def __init__(self, role: str, cfg: PDConfig, metrics: PDMetrics) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"a P/D worker is a prefill or a decode, not {role!r}")
        self.role, self.cfg, self.metrics = role, cfg, metrics
        self.curve = curve_keys(cfg)  # its public half goes in /v1/pd/info
        if cfg.pd_insecure:
            print(
                f"kvstrata serve: WARNING: --pd-insecure: this {role} worker's KV transfer is "
                "not authenticated; any process that reaches it can exchange KV pages with it",
                file=sys.stderr,
                flush=True,
            )
        self.picker: PrefillPicker | None = None
        if role == "decode":
            resolver = Resolver(cfg.pd_timeout_s, prefill_auth(cfg))
            allowed = PrefillSet(cfg.prefill_urls, resolver, cfg.pd_trust_request_prefill)
            self.picker = PrefillPicker(allowed, cfg.prefill_urls)
        self.layout: Layout | None = None
        self.endpoints: list[str] = []  # prefill: every rank's transfer endpoint (rank order)
        self.ranks = 0  # how many ranks reported (0 until they are up)

    def choose(self, wanted: str | None) -> str:
        """A new request's prefill worker (decode; see PrefillPicker.choose)."""
        if self.picker is None:
            raise ValueError(f"a {self.role} worker picks no prefill worker")
        return self.picker.choose(wanted)

    def report(self, msg: PDReport) -> None:
        """A report of rank 0's side (its thread, or the dispatcher of the ranks' outbox)."""
        if isinstance(msg, SideUp):
            self.layout = Layout(**msg.layout)
            self.endpoints = list(msg.endpoints) if self.role == "prefill" else []
            self.ranks = len(msg.endpoints)
        else:
            self.metrics.record(msg)

    @property
    def transfer_endpoint(self) -> str:
        return self.endpoints[0] if self.endpoints else ""

    def info(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "transport": self.cfg.pd_transport,
            "transfer_endpoint": self.transfer_endpoint,
            # one per rank (rank order); rank r of a decode worker talks to rank r
            "transfer_endpoints": list(self.endpoints),
            "prefill": self.cfg.prefill_urls if self.role == "decode" else [],
            # the listener's CURVE public key (z85): decode talks to it only if it is one of
            # its own --pd-curve-peers-dir keys ("": no CURVE)
            "curve_public_key": self.curve.public.decode() if self.curve is not None else "",
            "layout": self.layout.as_dict() if self.layout is not None else None,
        }

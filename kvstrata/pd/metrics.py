"""P/D counters: each rank's own counts (RankCounts, what its sides call) and the HTTP side's
`kvstrata:pd_*` Prometheus counters (PDMetrics), fed by the typed reports of kvstrata/pd/reports.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from kvstrata.pd.reports import (
    HandoffFailed,
    HandoffReceived,
    HandoffRetried,
    HoldExpired,
    PagesPulled,
    PagesSent,
    PDCount,
    PDReport,
)

Report = Callable[[PDReport], None]
"""Where a rank's reports go: the HTTP side itself (one rank), rank 0's outbox (several)."""


class RankCounts:
    """This rank's own P/D counters, measured on its part of every page (/v1/pd/ranks), and
    the same events as whole pages to `report` (None: a rank that does not report). The one
    metrics type of a side, on one rank and on many. Bumped on the engine and listener
    threads."""

    NAMES = ("pages_sent", "bytes_sent", "pages_received", "bytes_received", "ok", "failed")

    def __init__(self, report: Report | None) -> None:
        self.report = report
        self.page_bytes = self.part_bytes = 0  # a whole page / this rank's part (set on attach)
        pulls = [f"{x}_pull_{d}" for d in ("sent", "received") for x in ("pages", "bytes")]
        self.counts = dict.fromkeys((*self.NAMES, "retried", "held_expired", *pulls), 0)

    def _report(self, event: PDCount) -> None:
        if self.report is not None:
            self.report(event)

    def sent(self, pages: int, nbytes: int) -> None:
        """A hand-off's pages are queued (its bytes are counted as they go: `wire`)."""
        self.counts["ok"] += 1
        self.counts["pages_sent"] += pages
        self._report(PagesSent(pages, pages * self.page_bytes))

    def wire(self, nbytes: int) -> None:
        """Bytes this rank put on the wire (its part; the HTTP side counts whole pages)."""
        self.counts["bytes_sent"] += nbytes

    def received(self, usage: dict[str, Any], part_bytes: int) -> None:
        """usage: the request's usage.pd (whole pages); part_bytes: this rank's bytes."""
        self.counts["ok"] += 1
        self.counts["pages_received"] += part_bytes // self.part_bytes  # this rank's pages
        self.counts["bytes_received"] += part_bytes
        self._report(HandoffReceived(usage))

    def pulled(self, direction: str, pages: int, nbytes: int) -> None:
        """Held pages pulled (pull_sent on decode, pull_received on prefill): this rank's part
        bytes here, whole pages reported (as usage.pd counts them)."""
        self.counts[f"pages_{direction}"] += pages
        self.counts[f"bytes_{direction}"] += nbytes
        self._report(PagesPulled(direction, pages, pages * self.page_bytes))

    def failed(self) -> None:
        self.counts["failed"] += 1
        self._report(HandoffFailed())

    def retried(self) -> None:
        self.counts["retried"] += 1
        self._report(HandoffRetried())

    def held_expired(self) -> None:
        """Prefill gave up a hand-off's held pages (never sent within pd_timeout_s)."""
        self.counts["held_expired"] += 1
        self._report(HoldExpired())


class PDMetrics:
    """The worker's hand-off counters (thread-safe), from its ranks' reports."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        lbl, self.name = ["model_name"], model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"kvstrata:{name}", doc, [*lbl, *extra], registry=registry)

        self.pages = counter("pd_pages", "KV pages of P/D hand-offs", ("direction",))
        self.bytes = counter("pd_bytes", "KV bytes of P/D hand-offs", ("direction",))
        self.skipped = counter("pd_pages_skipped", "prompt pages decode held: not sent")
        self.storage = counter("pd_pages_from_storage", "held pages decode took from storage")
        self.computed = counter("pd_prefill_computed_tokens", "prompt tokens prefill computed")
        self.handoffs = counter("pd_handoffs", "hand-offs by outcome", ("outcome",))
        self.expired = counter(
            "pd_held_expired", "hand-offs whose held pages prefill released unsent"
        )

    def record(self, event: PDCount) -> None:
        """One counter event of a rank (whole pages)."""
        if isinstance(event, PagesSent | PagesPulled):
            direction = "sent" if isinstance(event, PagesSent) else event.direction
            self.pages.labels(self.name, direction).inc(event.pages)
            self.bytes.labels(self.name, direction).inc(event.nbytes)
            if isinstance(event, PagesSent):
                self.handoffs.labels(self.name, "ok").inc()
        elif isinstance(event, HandoffReceived):
            usage = event.usage
            self.pages.labels(self.name, "received").inc(usage["pages_received"])
            self.bytes.labels(self.name, "received").inc(usage["bytes_received"])
            self.skipped.labels(self.name).inc(usage["pages_skipped"])
            self.storage.labels(self.name).inc(usage["pages_from_storage"])
            self.computed.labels(self.name).inc(usage["prefill_computed_tokens"])
            self.handoffs.labels(self.name, "ok").inc()
        elif isinstance(event, HandoffFailed):
            self.handoffs.labels(self.name, "failed").inc()
        elif isinstance(event, HandoffRetried):
            self.handoffs.labels(self.name, "retried").inc()
        elif isinstance(event, HoldExpired):
            self.expired.labels(self.name).inc()

"""The `kvstrata:pd_*` Prometheus counters of a P/D worker (pages, bytes and hand-offs)."""

from __future__ import annotations

from typing import Any

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
        self.storage = counter("pd_pages_from_storage", "held pages decode took from storage")
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

    def wire(self, nbytes: int) -> None:
        """Bytes on the wire: counted when the pages are queued (`sent`), whole pages."""

    def failed(self) -> None:
        self.handoffs.labels(self.name, "failed").inc()

    def retried(self) -> None:
        """A reply failed its checks (e.g. a page checksum) and the hand-off was asked again."""
        self.handoffs.labels(self.name, "retried").inc()

"""A P/D worker's ranks report to its HTTP side in typed messages: counter events (whole pages)
into the worker's Prometheus counters, this rank's own part counts kept on the rank, and the
layout and every rank's endpoint once up. One rank hands them over directly; rank 0 of several
puts the same objects on its outbox (here: a real multiprocessing queue, pickled)."""

from __future__ import annotations

import multiprocessing

from prometheus_client import CollectorRegistry

from kvstrata.pd.config import PDConfig
from kvstrata.pd.metrics import PDMetrics, RankCounts
from kvstrata.pd.reports import REPORTS, SideUp
from kvstrata.pd.wire import Layout
from kvstrata.pd.worker import PDWorker

PAGE = 4096  # a whole page's bytes
PART = 1024  # this rank's part of it (tp=4)


def _worker(role: str) -> tuple[PDWorker, CollectorRegistry]:
    registry = CollectorRegistry()
    cfg = PDConfig(pd_insecure=True, pd_prefill="http://127.0.0.1:1" if role == "decode" else "")
    return PDWorker(role, cfg, PDMetrics(registry, "m")), registry


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(f"kvstrata:{name}", {"model_name": "m", **labels})


def _counts(report: object) -> RankCounts:
    counts = RankCounts(report)  # type: ignore[arg-type]
    counts.page_bytes, counts.part_bytes = PAGE, PART
    return counts


def test_one_rank_reports_straight_to_its_http_side() -> None:
    worker, registry = _worker("prefill")
    counts = _counts(worker.report)
    counts.sent(3, 3 * PART)
    counts.wire(3 * PART)
    counts.pulled("pull_received", 2, 2 * PART)
    counts.failed()
    counts.retried()
    assert _value(registry, "pd_pages_total", direction="sent") == 3
    assert _value(registry, "pd_bytes_total", direction="sent") == 3 * PAGE  # whole pages
    assert _value(registry, "pd_pages_total", direction="pull_received") == 2
    assert _value(registry, "pd_bytes_total", direction="pull_received") == 2 * PAGE
    assert _value(registry, "pd_handoffs_total", outcome="ok") == 1
    assert _value(registry, "pd_handoffs_total", outcome="failed") == 1
    assert _value(registry, "pd_handoffs_total", outcome="retried") == 1
    # the rank's own counts: its part's bytes, as measured on it
    c = counts.counts
    assert (c["pages_sent"], c["bytes_sent"], c["ok"], c["failed"], c["retried"]) == (
        3, 3 * PART, 1, 1, 1,
    )  # fmt: skip
    assert (c["pages_pull_received"], c["bytes_pull_received"]) == (2, 2 * PART)


def test_rank0_reports_cross_a_process_queue_typed() -> None:
    worker, registry = _worker("decode")
    outbox = multiprocessing.get_context("spawn").Queue()
    rank0 = _counts(outbox.put)
    other = _counts(None)  # a rank that does not report still counts its own part
    usage = {
        "pages_received": 5,
        "bytes_received": 5 * PAGE,
        "pages_skipped": 2,
        "pages_from_storage": 1,
        "prefill_computed_tokens": 40,
    }
    rank0.received(usage, 5 * PART)
    other.received(usage, 5 * PART)
    layout = Layout(8, "float32", "fp", "", 2, 4, 16, tp=4, page_bytes=PAGE)
    outbox.put(SideUp(layout.as_dict(), ["", "", "", ""]))
    for _ in range(2):
        msg = outbox.get(timeout=30)
        assert isinstance(msg, REPORTS)
        worker.report(msg)
    assert _value(registry, "pd_pages_total", direction="received") == 5
    assert _value(registry, "pd_bytes_total", direction="received") == 5 * PAGE
    assert _value(registry, "pd_pages_skipped_total") == 2
    assert _value(registry, "pd_pages_from_storage_total") == 1
    assert _value(registry, "pd_prefill_computed_tokens_total") == 40
    for counts in (rank0, other):
        assert (counts.counts["pages_received"], counts.counts["bytes_received"]) == (5, 5 * PART)
    info = worker.info()
    assert worker.ranks == 4
    assert info["layout"] == layout.as_dict() and info["transfer_endpoints"] == []
    assert info["prefill"] == ["http://127.0.0.1:1"]


def test_prefill_side_up_gives_every_rank_endpoint() -> None:
    worker, _ = _worker("prefill")
    assert worker.info()["layout"] is None  # nothing reported yet
    layout = Layout(8, "float32", "fp", "", 2, 4, 16, page_bytes=PAGE)
    worker.report(SideUp(layout.as_dict(), ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"]))
    info = worker.info()
    assert info["transfer_endpoint"] == "tcp://127.0.0.1:5000"
    assert info["transfer_endpoints"] == ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"]
    try:
        worker.choose(None)
    except ValueError as exc:
        assert str(exc) == "a prefill worker picks no prefill worker"
    else:
        raise AssertionError("a prefill worker must not pick a prefill worker")

"""What a P/D worker's ranks tell its HTTP side, typed: hand-off counters and, once up, the
worker's layout and every rank's transfer endpoint.

One rank hands them straight to the HTTP side (kvstrata.pd.worker.PDWorker.report); under
several ranks rank 0 puts them on its outbox and the HTTP process's dispatcher hands them on.
Counters are whole pages (what usage.pd counts); each rank keeps its own part's counts itself
(kvstrata.pd.metrics.RankCounts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PagesSent:
    """A hand-off's pages were queued for decode (prefill)."""

    pages: int
    nbytes: int  # whole pages


@dataclass(frozen=True)
class HandoffReceived:
    """A hand-off landed (decode)."""

    usage: dict[str, Any]  # the request's usage.pd


@dataclass(frozen=True)
class PagesPulled:
    """Held pages prefill pulled from decode: "pull_sent" on decode (every page it sent),
    "pull_received" on prefill (the pages that passed their checksums and were used)."""

    direction: str
    pages: int
    nbytes: int  # whole pages


@dataclass(frozen=True)
class HandoffFailed:
    """A hand-off failed (refused, timed out, or its pages failed their checks)."""


@dataclass(frozen=True)
class HandoffRetried:
    """A reply failed its checks (e.g. a page checksum) and the hand-off was asked again."""


@dataclass(frozen=True)
class HoldExpired:
    """Prefill held a hand-off's pages for pd_timeout_s and they were never sent: released."""


@dataclass(frozen=True)
class SideUp:
    """Every rank's side is up: the worker's layout (as rank 0 speaks it) and every rank's
    transfer endpoint, rank order ("" on a decode rank: it listens on none)."""

    layout: dict[str, Any]
    endpoints: list[str]


PDCount = PagesSent | HandoffReceived | PagesPulled | HandoffFailed | HandoffRetried | HoldExpired
PDReport = PDCount | SideUp
REPORTS = (
    PagesSent,
    HandoffReceived,
    PagesPulled,
    HandoffFailed,
    HandoffRetried,
    HoldExpired,
    SideUp,
)
"""Every PDReport type (an isinstance check on a queue's messages)."""

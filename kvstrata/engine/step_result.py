"""What one engine step did: the requests it admitted, those that ended in it, and the page keys
its requests' leases cached (with their tokens and cache_salt).

The engine's callers (the step loop, workload feeds, benchmarks, tests, the KV event publisher)
learn who was admitted, finished or failed and what the tree's new pages hold from this, never by
reading the scheduler's waiting and running lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.engine.request import Request


@dataclass(frozen=True)
class PagesCached:
    """Consecutive pages of one request that are in the tree: committed by it, landed by its
    storage prefetch (before it was admitted), or matched there. Keys are chained, so a key has
    one token run and one salt wherever it appears."""

    keys: list[int]
    """Page keys, in chain order."""
    tokens: list[int]
    """The pages' token ids, page_size per key, in the same order."""
    salt: str
    """The request's cache_salt ("" when unsalted): a salted key is the salt's alone."""


@dataclass(frozen=True)
class StepResult:
    """One step's outcome, in the order things happened."""

    admitted: list[Request] = field(default_factory=list)
    """Left the queue in this step (a preempted request again when it is readmitted)."""
    ended: list[Request] = field(default_factory=list)
    """Finished or failed in this step, in the order they ended (req.failure: failed)."""
    cached: list[PagesCached] = field(default_factory=list)
    """Pages requests cached or matched since the last result was taken (in this step, or
    between steps: an abort's or a reset's last commit), in the order it happened."""

    @property
    def finished(self) -> list[Request]:
        """Ended with a finish reason ("length", "stop", "abort"): no failure."""
        return [req for req in self.ended if req.failure is None]

    @property
    def failed(self) -> list[Request]:
        """Ended with a failure (req.failure: HTTP status and message)."""
        return [req for req in self.ended if req.failure is not None]

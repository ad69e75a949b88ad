"""What one engine step did: the requests it admitted and those that ended in it.

The engine's callers (the step loop, workload feeds, benchmarks, tests) learn who was admitted,
finished or failed from this, never by reading the scheduler's waiting and running lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.engine.request import Request


@dataclass(frozen=True)
class StepResult:
    """One step's outcome, in the order things happened."""

    admitted: list[Request] = field(default_factory=list)
    """Left the queue in this step (a preempted request again when it is readmitted)."""
    ended: list[Request] = field(default_factory=list)
    """Finished or failed in this step, in the order they ended (req.failure: failed)."""

    @property
    def finished(self) -> list[Request]:
        """Ended with a finish reason ("length", "stop", "abort"): no failure."""
        return [req for req in self.ended if req.failure is None]

    @property
    def failed(self) -> list[Request]:
        """Ended with a failure (req.failure: HTTP status and message)."""
        return [req for req in self.ended if req.failure is not None]

"""Typed messages in and out of a step loop: what every rank applies before a step, and what
rank 0 (or the one rank) reports back. Plain frozen dataclasses: they cross process queues and
torch.distributed's object broadcast by pickle, and are read by field, never by index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstrata.cache.pins import PinSpec
from kvstrata.engine.request import Request
from kvstrata.engine.sampling import Sampler, SamplingParams

# ---- inputs: the HTTP side (or a P/D listener) -> rank 0's inbox -> every rank ---------------
# (one rank: the same messages, through an in-process queue; the engine's Request is built here)


@dataclass(frozen=True)
class NewRequest:
    """A request as every rank rebuilds it (a sampler is rebuilt from params and rid, so every
    rank draws the same tokens)."""

    rid: str
    tokens: list[int]
    max_new_tokens: int
    params: SamplingParams | None = None  # None: greedy
    cache_salt: str = ""
    kv_params: dict[str, Any] | None = None
    """What the engine's connector needs of it (Request.kv_params): P/D decode names the
    prefill worker; P/D prefill carries the checked hand-off ({"pd_held": pages decode holds,
    "pd_owners": ...})."""
    keep_logits: bool = False  # P/D prefill: the first-token row travels to decode
    pins: tuple[PinSpec, ...] = ()  # client pins: every rank pins the same prefixes

    def build(self) -> Request:
        sampler = Sampler(self.params, self.rid) if self.params is not None else None
        req = Request(
            self.rid, self.tokens, self.max_new_tokens, sampler=sampler, cache_salt=self.cache_salt
        )
        req.kv_params, req.keep_logits, req.pins = self.kv_params, self.keep_logits, self.pins
        return req


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class Call:
    """Run fn(engine) between steps on every rank (fn: a module-level function)."""

    call_id: int
    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class Stop:
    """Abort what is left, drain pending cache ops, end the loop."""


InboxItem = NewRequest | Abort | Call | Stop
"""What goes into a step loop's inbox."""


class Inbox(Protocol):
    """A step loop's inbox (a queue.Queue, or a process queue under ranks): the HTTP side and
    P/D prefill's listener (its checked hand-offs and cancels) put, the step loop takes."""

    def put(self, item: InboxItem) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> InboxItem: ...

    def get_nowait(self) -> InboxItem: ...


@dataclass(frozen=True)
class StepInputs:
    """What every rank applies before its next step, as rank 0 decided it."""

    new: list[NewRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    clock: float = 0.0  # rank 0's time: the agreed clock of prefetch budgets
    stop: bool = False
    step: bool = False  # whether every rank steps (work is in flight or arrived)
    calls: list[Call] = field(default_factory=list)


# ---- outputs: rank 0 -> the HTTP side --------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Every rank is up."""


@dataclass(frozen=True)
class TokenOut:
    rid: str
    token: int


@dataclass(frozen=True)
class Admitted:
    """A request left the queue in the step that began at `at_s` (the reporting rank's time)."""

    rid: str
    hits: dict[str, int]  # prompt pages each tier served
    at_s: float


@dataclass(frozen=True)
class Finished:
    rid: str
    reason: str | None
    hits: dict[str, int]
    transfer: dict[str, Any] | None  # P/D decode: what crossed for it (usage.pd)
    spec_accepts: list[int] = field(default_factory=list)
    spec_proposed: int = 0
    pinned_pages: int = 0  # the longest prefix the request's pins kept


@dataclass(frozen=True)
class Failed:
    rid: str
    error: str | tuple[int, str]  # a message (400), or (HTTP status, message)


@dataclass(frozen=True)
class StatsOut:
    stats: Any  # kvstrata.serve.metrics.PoolStats
    agree_s: list[float]  # durations of the step agreements since the last report


@dataclass(frozen=True)
class CallDone:
    call_id: int
    results: list[tuple[bool, Any]]  # per rank: (ok, result or error message)


StepOutput = TokenOut | Admitted | Finished | Failed | StatsOut | CallDone
"""What a step loop reports (rank 0's, or the one rank's)."""

"""The HTTP side's own record of a request: what the client asked for, and what the engine
reported of it. The engine builds its own Request from `new()` (on every rank, one alike); the
HTTP side never reads or writes that object, and the engine thread never touches this one
(its outputs arrive as Admitted / Finished messages, applied on the thread that handles them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstrata.cache.pins import PinSpec
from kvstrata.engine.request import accept_length, acceptance_rate
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.step_io import Admitted, Finished, NewRequest


def _no_hits() -> dict[str, int]:
    return {"device": 0, "host": 0, "storage": 0}


@dataclass
class RequestRecord:
    """One request as the HTTP side knows it (usage, metrics, finish reason read this)."""

    rid: str
    tokens: list[int]
    max_new_tokens: int
    params: SamplingParams
    cache_salt: str = ""
    kv_params: dict[str, Any] | None = None  # P/D decode: {"prefill": the worker to ask}
    pins: tuple[PinSpec, ...] = ()  # prefixes the client asked to keep
    # --- what the engine reported -------------------------------------------------------------
    hits: dict[str, int] = field(default_factory=_no_hits)
    """Prompt pages each tier served: at admission, then as the request ended."""
    finish_reason: str | None = None  # "length", "stop", "abort" or "error"
    transfer: dict[str, Any] | None = None  # P/D decode: what crossed for it (usage.pd)
    spec_accepts: list[int] = field(default_factory=list)  # accepted drafts per verify step
    spec_proposed: int = 0
    pinned_pages: int = 0  # the longest prefix its pins kept

    def new(self) -> NewRequest:
        """What the engine builds its own Request from."""
        return NewRequest(
            self.rid, self.tokens, self.max_new_tokens, self.params, self.cache_salt,
            self.kv_params, pins=self.pins,
        )  # fmt: skip

    def admitted(self, msg: Admitted) -> None:
        self.hits = dict(msg.hits)

    def finished(self, msg: Finished) -> None:
        self.finish_reason, self.hits, self.transfer = msg.reason, dict(msg.hits), msg.transfer
        self.spec_accepts, self.spec_proposed = list(msg.spec_accepts), msg.spec_proposed
        self.pinned_pages = msg.pinned_pages

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.spec_accepts, self.spec_proposed)

    @property
    def accept_length(self) -> float:
        return accept_length(self.spec_accepts)

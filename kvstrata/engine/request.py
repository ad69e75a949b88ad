"""A request's life in the engine: waiting (its cache lease) -> prefill -> decode -> done."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata.cache.lease import Hits, Lease
from kvstrata.cache.pins import PinSpec
from kvstrata.engine.sampling import Sampler


def acceptance_rate(accepts: list[int], proposed: int) -> float:
    """Accepted / proposed drafts (0.0 before any verify step)."""
    return sum(accepts) / proposed if proposed else 0.0


def accept_length(accepts: list[int]) -> float:
    """Mean tokens emitted per verify step: accepted drafts + the target's own token."""
    return (sum(accepts) + len(accepts)) / len(accepts) if accepts else 0.0


class State(enum.Enum):
    WAITING = "waiting"  # its lease matches, probes storage, prefetches, or waits for device room
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    """Admitted (its pages allocated) while another worker fills some of them: the scheduler
    plans none of its prompt until the engine's connector says they landed or failed."""
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class Request:
    """One prompt of token ids and how many tokens to generate (greedy, or by its sampler)."""

    rid: str
    tokens: list[int]
    max_new_tokens: int = 16
    arrival_s: float = 0.0
    keep_logits: bool = False
    """Keep every produced logits row (tests compare them with recomputation)."""
    sampler: Sampler | None = None  # None: greedy, ends only at max_new_tokens
    cache_salt: str = ""  # mixed into the page keys: requests with other salts share no page
    kv_params: dict[str, Any] | None = None
    """What the engine's connector needs of this request (vLLM's kv_transfer_params; opaque to
    the engine). P/D decode: {"prefill": the worker that computes the prompt}; P/D prefill:
    the checked hand-off ({"pd_held": pages decode holds, ...})."""
    transfer: dict[str, Any] | None = None  # P/D decode: what crossed for it (usage.pd)
    pins: tuple[PinSpec, ...] = ()  # prefixes the client asked to keep (cache_control, kv_pin_s)
    pinned_pages: int = 0  # the longest prefix its pins kept (usage.pinned_tokens)

    # --- engine state -------------------------------------------------------------------------
    state: State = State.WAITING
    lease: Lease | None = None  # the request's way through the cache (kvstrata.cache.lease)
    computed: int = 0  # tokens whose KV is in the pool
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] per produced token
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None  # "length", "stop" (a stop token) or "abort"
    failure: tuple[int, str] | None = None  # (HTTP status, message) of a failed remote prefill
    # --- speculative decoding (kvstrata.engine.speculative); None/empty when off ---------------
    draft_computed: int | None = None  # tokens whose draft KV (the pages' tail layers) is final
    spec_proposed: int = 0  # drafted tokens the target verified
    spec_accepts: list[int] = field(default_factory=list)  # accepted drafts per verify step
    draft_hidden: torch.Tensor | None = None
    """MTP head only: the target's hidden states [computed - draft_computed + 1, hidden] at
    positions draft_computed - 1 .. computed - 1, the inputs of the entries not yet written."""

    @property
    def final_kv_tokens(self) -> int:
        """Leading tokens whose KV, target's and draft's, is final (pages up to here may be cached)."""
        if self.draft_computed is None:
            return self.computed
        return min(self.computed, self.draft_computed)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.spec_accepts, self.spec_proposed)

    @property
    def accept_length(self) -> float:
        return accept_length(self.spec_accepts)

    @property
    def all_tokens(self) -> list[int]:
        return self.tokens + self.output

    @property
    def prefill_tokens(self) -> list[int]:
        """What prefill computes: the prompt; after a preemption also every generated token but
        the last (whose KV the next decode step writes, as if never preempted)."""
        return self.tokens + self.output[:-1] if self.output else self.tokens

    @property
    def prefill_len(self) -> int:
        """len(prefill_tokens), without building the list (the scheduler asks every step)."""
        return len(self.tokens) + max(0, len(self.output) - 1)

    @property
    def page_table(self) -> list[int]:
        """Device page of each logical page (empty before admission and after release)."""
        return self.lease.page_table if self.lease is not None else []

    @property
    def hits(self) -> dict[str, int]:
        """Prompt pages served by each tier of its lease: device, host, storage."""
        h = self.lease.hits if self.lease is not None else Hits()
        return {"device": h.device, "host": h.host, "storage": h.storage}

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    def pages_needed(self, page_size: int) -> int:
        """Pages for the prompt and every generated token whose KV is written."""
        return -(-(len(self.tokens) + self.max_new_tokens - 1) // page_size)

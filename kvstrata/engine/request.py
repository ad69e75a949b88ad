"""A request's life in the engine: waiting (probe, prefetch) -> prefill -> decode -> done."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvstrata.cache.ops import TransferOp
from kvstrata.cache.radix import Match, Node
from kvstrata.engine.sampling import Sampler


class State(enum.Enum):
    WAITING = "waiting"  # not matched yet, or waiting for L1 room
    PROBING = "probing"  # asked storage how much of the prompt it holds
    PREFETCHING = "prefetching"  # L3 -> L2 copy under way
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class Request:
    """One prompt of token ids and how many tokens to generate greedily."""

    rid: str
    tokens: list[int]
    max_new_tokens: int = 16
    arrival_s: float = 0.0
    keep_logits: bool = False
    """Keep every produced logits row (tests compare them with recomputation)."""
    sampler: Sampler | None = None  # None: greedy, ends only at max_new_tokens
    cache_salt: str = ""  # mixed into the page keys: requests with other salts share no page

    # --- engine state -------------------------------------------------------------------------
    state: State = State.WAITING
    keys: list[int] = field(default_factory=list)  # page keys of the cacheable prompt pages
    match: Match | None = None
    locked: Node | None = None  # the tree node this request holds locked
    probe: TransferOp | None = None
    prefetch: TransferOp | None = None
    load: TransferOp | None = None  # L2 -> L1 copy the first forward waits on, layer by layer
    page_table: list[int] = field(default_factory=list)  # device page of each logical page
    computed: int = 0  # tokens whose KV is in the pool
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] per produced token
    hits: dict[str, int] = field(default_factory=lambda: {"L1": 0, "L2": 0, "L3": 0})
    l3_pages: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None  # "length", "stop" (a stop token) or "abort"

    @property
    def all_tokens(self) -> list[int]:
        return self.tokens + self.output

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    def pages_needed(self, page_size: int) -> int:
        """Pages for the prompt and every generated token whose KV is written."""
        return -(-(len(self.tokens) + self.max_new_tokens - 1) // page_size)

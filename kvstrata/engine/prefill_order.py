"""Which running prompt a step's prefill budget goes to first (`EngineConfig.prefill_order`).

A step carries up to `max_batch_tokens` prompt tokens; when the running prompts need more, the
order decides whose first token waits a step. Orders are chosen by name through PREFILL_ORDERS:
- `arrival`: in admission order (vLLM's and SGLang's default): the first prompt takes what it
  can, the next one the rest;
- `shortest`: the prompts with the fewest tokens left go first (ties in admission order). A
  returning turn whose history the cache holds computes only its new part, so it finishes in
  the next step instead of queueing behind a long cold prompt; the long prompt's first token
  moves by that much. Mean TTFT is lowest this way (shortest remaining work first). The prompts
  that got no tokens at all in the previous step go before every other (in admission order
  among themselves), so a prompt passed over waits at most one step per prompt passed over
  before it, never for the shorter ones that keep arriving.

An order reads agreed state only (a request's prompt length and computed count, admission
order, the previous plan), so every rank plans alike.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from kvstrata.engine.request import Request
from kvstrata.registry import Registry

PrefillOrder = Callable[[list[Request], Collection[str]], list[Request]]
"""(prompts being prefilled, in admission order; rids passed over last step) -> planning order."""

PREFILL_ORDERS: Registry[list[Request]] = Registry("prefill order")  # name -> PrefillOrder


def tokens_left(req: Request) -> int:
    """Prompt tokens the request has still to compute."""
    return req.prefill_len - req.computed


@PREFILL_ORDERS.register("arrival")
def arrival(prefilling: list[Request], passed_over: Collection[str]) -> list[Request]:
    # the oldest prompt always goes first: none is passed over for ever
    return prefilling


@PREFILL_ORDERS.register("shortest")
def shortest(prefilling: list[Request], passed_over: Collection[str]) -> list[Request]:
    def key(req: Request) -> tuple[bool, int]:
        starved = req.rid in passed_over
        return (not starved, 0 if starved else tokens_left(req))

    return sorted(prefilling, key=key)  # stable: ties keep admission order

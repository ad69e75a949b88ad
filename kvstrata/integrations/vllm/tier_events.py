"""Which pages kvstrata's host and storage tiers gained or lost since vLLM last asked.

vLLM's scheduler drains `take_events` once per step and publishes the events with its own (its
device blocks, medium GPU). The connector adds its tiers: the cache tree's per-medium changes
(kvstrata.cache.events.BlockTracker, the rule our own server's event stream uses), host as medium
"CPU" and storage as "DISK". kvstrata's device tier is transit pages only (vLLM's blocks of a
running request, which vLLM reports itself), so "GPU" changes are left out, and so are "DISK"
removals: the tree forgets a storage page when its host copy is evicted (a later request probes
the store again), which removes nothing from the store, and the stores evict on their own,
unseen (file size cap, redis expiry). A stored run carries
its pages' token ids, recorded from the requests whose leases learnt the keys; a key is forgotten
once no medium holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.cache.events import BlockChange, BlockTracker
from kvstrata.cache.radix import RadixTree

HOST, STORAGE = "CPU", "DISK"  # kvstrata.cache.events' medium names


@dataclass(frozen=True)
class TierChange:
    """A run of pages entering or leaving one of kvstrata's media, with their token ids."""

    change: BlockChange
    tokens: list[int]  # stored: every page's tokens in order; removed: empty
    salts: list[str]  # stored: each page's cache_salt ("" unsalted); removed: empty


class TierEvents:
    """Tracks the tree between takes and the token ids of every page it may report."""

    def __init__(self, page_size: int) -> None:
        self.page = page_size
        self.tracker = BlockTracker()
        self.tokens: dict[int, list[int]] = {}  # page key -> its page_size token ids
        self.salts: dict[int, str] = {}  # page key -> its request's cache_salt (salted only)

    def record(
        self, keys: Sequence[int], token_ids: Sequence[int], start: int = 0, salt: str = ""
    ) -> None:
        """Pages [start, len(keys)) of one request: keys[i] holds token_ids[i*page:(i+1)*page]."""
        p = self.page
        for i in range(start, len(keys)):
            if keys[i] not in self.tokens:
                self.tokens[keys[i]] = list(token_ids[i * p : (i + 1) * p])
            if salt:
                self.salts[keys[i]] = salt

    def take(self, tree: RadixTree) -> list[TierChange]:
        out = [
            TierChange(c, *self._pages(c))
            for c in self.tracker.diff(tree)
            if c.medium == HOST or (c.medium == STORAGE and c.stored)
        ]
        if out:
            held = set().union(*self.tracker.held.values())
            for key in [k for k in self.tokens if k not in held]:
                del self.tokens[key]
                self.salts.pop(key, None)
        return out

    def _pages(self, change: BlockChange) -> tuple[list[int], list[str]]:
        """A stored change's tokens and per-page salts (a removal carries neither)."""
        if not change.stored:
            return [], []
        toks = [t for k in change.keys for t in self.tokens.get(k, [])]
        return toks, [self.salts.get(k, "") for k in change.keys]

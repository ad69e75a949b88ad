"""Prefetch hints (POST /v1/kv/prefetch): bring a prompt's pages up the tiers before it comes.

A hint is a cache lease (kvstrata.cache.lease) that is never admitted: it matches and locks the
prompt's cached prefix, asks storage for the pages after it and reads them into host memory
(the lease's own probe and prefetch), then loads the host pages to the device where there is
room without taking a pinned or running page (`Lease.warm`), and lets go once that load is
applied. Hints enter through a call every rank runs between the same two steps and advance on
the agreed step clock, so every rank moves the same pages.

Bounded: the pages all hints may have in flight (read from storage, loaded to the device) stay
within `max_pages`; a hint past it moves only what room is left (or nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.cache.chain import PageChain
from kvstrata.cache.hicache import HiCache
from kvstrata.cache.keys import Namespace
from kvstrata.cache.lease import Lease


@dataclass(frozen=True)
class HintAnswer:
    """Pages of the prompt each tier held when the hint came, and what it set moving."""

    hint_id: int
    device: int
    host: int
    fetch_cap: int  # pages the hint may read from storage (0: the bound is spent)
    probing: bool  # storage was asked: `storage` comes later (PrefetchHints.storage_found)


class PrefetchHints:
    """The hints in flight of one cache, advanced once per step."""

    def __init__(self, cache: HiCache, vocab_size: int, max_pages: int) -> None:
        self.cache, self.vocab_size, self.max_pages = cache, vocab_size, max_pages
        self.live: dict[int, Lease] = {}
        self.found: dict[int, int | None] = {}  # hint id -> pages storage held (None: asked)
        self._next = 0

    def start(self, tokens: list[int], ns: Namespace, now_s: float) -> HintAnswer:
        """Match and lock the prompt's full pages, start the storage probe; answer at once."""
        self._next += 1
        hid = self._next
        chain = PageChain.from_tokens(tokens, ns, self.vocab_size)
        # every full page may be a hit of the request that follows (a longer prompt)
        lease = Lease(self.cache, chain, chain.pages * ns.page_size + 1, 0, ns.page_size)
        room = max(0, self.max_pages - self.in_flight())
        lease.fetch_cap = room
        lease.advance(now_s, can_schedule=False)
        m = lease.match
        assert m is not None
        probing = lease.probe is not None and room > 0
        self.found[hid] = None if probing else 0
        self.live[hid] = lease
        self._settle(hid, lease, now_s)
        return HintAnswer(hid, m.device_pages, m.host_pages, room, probing)

    def storage_found(self, hid: int) -> int | None:
        """Pages after the cached prefix that storage held (None: not answered yet)."""
        return self.found.get(hid, 0)

    def advance(self, now_s: float) -> None:
        """One step: move every live hint as far as agreed state allows."""
        for hid, lease in list(self.live.items()):
            self._settle(hid, lease, now_s)

    def in_flight(self) -> int:
        """Pages the live hints are reading from storage or loading to the device."""
        pages = 0
        for lease in self.live.values():
            op = lease.prefetch
            pages += op.pages if op is not None and op.agreed is None else 0
            load = lease.load
            pages += load.pages if load is not None and load.agreed is None else 0
        return pages

    def _settle(self, hid: int, lease: Lease, now_s: float) -> None:
        probe = lease.probe
        if self.found.get(hid, 0) is None and probe is not None and probe.agreed is not None:
            self.found[hid] = probe.agreed
        if lease.load is None:
            # waiting on storage: never stopped early, the hint wants every page it named
            if not lease.advance(now_s, can_schedule=False):
                return
            room = self.max_pages - self.in_flight()
            lease.warm(room)
        if lease.load is None or lease.load.agreed is not None:
            lease.release()
            del self.live[hid]
            if len(self.found) > 1024:  # answers nobody asked for: keep the newest
                for old in sorted(self.found)[: len(self.found) - 1024]:
                    del self.found[old]

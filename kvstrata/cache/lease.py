"""One request's way through the cache: a tensor-free lease, advanced at step boundaries.

    NEW --match+lock--> PROBING --agreed storage answer--> PREFETCHING --landed or stopped--> READY
                     \\______________ (nothing to ask storage) _______________________________/
    (NEW --probe_ahead()--> NEW: the probe asked before the step's agreement, nothing locked)
    READY --admit(): device pages for the rest + the host -> device load, all or nothing--> ADMITTED
    ADMITTED --commit(tokens) as prefill goes: full computed pages join the tree-->
    --release(): unlock, free what the tree did not take--> RELEASED

The engine's admission, trace replay, the simulator and the tests all drive this object; none
re-spells its steps. Every transition reads agreed state only (the tree, agreed op results and
the agreed clock passed in), so every rank moves every lease the same way.

Rules that live here, once:
- the page holding the last prompt token is never a hit: its logits must be computed;
- hits per tier come from the final match: device pages, host pages, and the host pages that this
  lease's own prefetch brought from storage count as storage;
- admission is all or nothing: a lease either owns every device page it needs or none;
- pages at or past `keep_private` never join the tree (so never reach host copies or storage):
  they serve this request only and are freed with it;
- a client's pin (cache/pins.py) takes hold once its pages are the tree's (matched at admission
  or committed), through the locked node that ends them; a hit renews the pins on its path;
- a page is hashed only when its key is needed (a storage probe, an insert): the match walks the
  request's token bytes, and the matched pages' keys come from the tree (cache/chain.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstrata.cache.chain import PageChain
from kvstrata.cache.hicache import HiCache
from kvstrata.cache.keys import Namespace
from kvstrata.cache.ops import TransferOp
from kvstrata.cache.pins import PinSpec
from kvstrata.cache.radix import Match, Node
from kvstrata.cache.tiers import Allocator


def hittable_pages(prompt_tokens: int, page_size: int) -> int:
    """Full pages a prompt may take from the cache (its last token is always computed)."""
    return max(0, prompt_tokens - 1) // page_size


class LeaseState(enum.Enum):
    NEW = "new"
    PROBING = "probing"  # asked storage how many of the pages after the device+host prefix it holds
    PREFETCHING = "prefetching"  # storage -> host copy under way, under the prefetch policy
    READY = "ready"  # matched; may be admitted
    ADMITTED = "admitted"  # owns its device pages; prefill/decode running
    RELEASED = "released"


@dataclass(frozen=True)
class Hits:
    """Prompt pages served by each tier (the rest is computed)."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def pages(self) -> int:
        return self.device + self.host + self.storage


class Lease:
    """A request's hold on cache pages, from first match to release.

    `chain` holds the request's full pages known so far (at least those the prompt may hit;
    `extend_tokens`/`extend_keys` add pages of generated tokens): a PageChain with token bytes,
    hashed lazily, or a plain list of chained keys (a key-only chain). `pages_needed` is every device
    page the request will write or read. Without a cache (`cache is None`) the lease only
    allocates from `allocator` and never matches or inserts.
    """

    def __init__(
        self,
        cache: HiCache | None,
        chain: PageChain | list[int],
        prompt_tokens: int,
        pages_needed: int,
        page_size: int,
        allocator: Allocator | None = None,
    ) -> None:
        if cache is None and allocator is None:
            raise ValueError("a lease without a cache needs a page allocator")
        self.cache, self.allocator = cache, allocator
        self.page = page_size
        if not isinstance(chain, PageChain):
            chain = PageChain.from_keys(chain, page_size)
        self.chain = chain
        self.match_pages = min(chain.pages, hittable_pages(prompt_tokens, page_size))
        self.pages_needed = pages_needed
        self.state = LeaseState.NEW
        self.match: Match | None = None
        self.locked: Node | None = None  # the deepest node this lease holds locked
        self.probe: TransferOp | None = None
        self.probe_from = 0  # the page the probe's keys start at (the memory match's end then)
        self.prefetch: TransferOp | None = None
        self.load: TransferOp | None = None  # host -> device copy the first forward waits on
        self.page_table: list[int] = []  # device page of each logical page once admitted
        self.inserted = 0  # leading pages of page_table that the tree owns
        # pages from this one on never join the tree (None: no such bound): their KV came from,
        # or was computed over, a peer not trusted to write this cache (kvstrata/pd/pull.py)
        self.shared_below: int | None = None
        self.from_storage = 0  # pages this lease's prefetch landed in host memory
        self.hits = Hits()
        self.fetch_cap: int | None = None  # a prefetch hint's bound on pages read from storage
        self.pin_specs: list[PinSpec] = []  # pins still to take hold (their pages not cached yet)
        self.pinned_pages = 0  # the longest prefix this lease pinned

    @classmethod
    def for_prompt(
        cls,
        cache: HiCache | None,
        tokens: list[int],
        namespace: Namespace,
        pages_needed: int,
        pins: list[PinSpec] | tuple[PinSpec, ...] = (),
        vocab_size: int | None = None,
        allocator: Allocator | None = None,
    ) -> Lease:
        """The lease of a request that prefills `tokens` under `namespace` (a salted one:
        `keys.salted`): their full pages' token bytes (validated against `vocab_size`
        when given), hashed only once a key is needed, and the client pins it enters with."""
        chain = PageChain.from_tokens(tokens, namespace, vocab_size)
        lease = cls(cache, chain, len(tokens), pages_needed, namespace.page_size, allocator)
        lease.want_pins(pins)
        return lease

    def want_pins(self, specs: list[PinSpec] | tuple[PinSpec, ...]) -> None:
        """Pin these prefixes as soon as their pages belong to the tree (shortest first)."""
        self.pin_specs = sorted(specs, key=lambda s: s.tokens)

    @property
    def keys(self) -> list[int]:
        """Keys of the leading pages known so far (every matched and every committed page)."""
        return self.chain.keys

    # ---- before admission ---------------------------------------------------------------------
    @property
    def waiting_on_storage(self) -> bool:
        return self.state in (LeaseState.PROBING, LeaseState.PREFETCHING)

    def probe_ahead(self) -> TransferOp | None:
        """Ask storage about the pages past the memory match before the step's agreement, so
        its answer may come with it and `advance` admit the request in this very step. Locks
        nothing and moves no recency (the match is made again by `advance`, after the step's
        moves are applied); returns the probe put, if any (one per lease)."""
        cache = self.cache
        if self.state is not LeaseState.NEW or self.probe is not None:
            return None
        if cache is None or not cache.has_storage:
            return None
        self.probe_from = cache.peek_chain(self.chain, self.match_pages).pages
        self.probe = cache.start_probe(self._keys_from(self.probe_from))
        return self.probe

    def advance(self, now_s: float, can_schedule: bool) -> bool:
        """Take every step agreed state allows; True once the lease may be admitted."""
        cache = self.cache
        if self.state is LeaseState.NEW:
            if cache is None:
                self.state = LeaseState.READY
                return True
            self._rematch()
            if self.probe is None or not self._probe_may_answer():
                self._ask_storage()
            self.state = LeaseState.PROBING if self.probe else LeaseState.READY
        if self.state is LeaseState.PROBING:
            if self.probe is None or self.probe.agreed is None:
                return False
            found = self._probe_answer()
            if found is None:  # asked ahead; the memory match has moved past what it covers
                self._ask_storage()
                return False
            self._start_prefetch(now_s, found)
        if self.state is LeaseState.PREFETCHING:
            op = self.prefetch
            assert cache is not None and op is not None
            if op.agreed is None:
                if cache.prefetch_should_stop(op, now_s, can_schedule):
                    cache.stop_prefetch(op)
                return False
            self.from_storage = op.agreed
            self._rematch()
            self.state = LeaseState.READY
        return self.state is not LeaseState.RELEASED

    def _ask_storage(self) -> None:
        """Probe storage for the pages past the match (no probe when there are none)."""
        cache = self.cache
        assert cache is not None and self.match is not None
        self.probe_from = self.match.pages
        # only a probe needs the keys of the pages past the match (hashed here, once)
        self.probe = cache.start_probe(self._after_match()) if cache.has_storage else None

    def _probe_may_answer(self) -> bool:
        """The probe asked ahead may still answer for the pages past the match: the match
        ends where its keys start, or it is pending, or its answer covers the match's end."""
        assert self.probe is not None and self.match is not None
        at = self.match.pages
        if self.probe.agreed is None:
            return at >= self.probe_from
        return self._probe_answer() is not None

    def _probe_answer(self) -> int | None:
        """Leading pages past the match that storage holds, from the agreed probe; None when
        it cannot say: it holds pages [probe_from, probe_from + agreed) and not the next one,
        so only a match ending in that range (or at its end) is answered."""
        assert self.probe is not None and self.probe.agreed is not None and self.match is not None
        at, end = self.match.pages, self.probe_from + self.probe.agreed
        return end - at if self.probe_from <= at <= end else None

    def _after_match(self) -> list[int]:
        assert self.match is not None
        return self._keys_from(self.match.pages)

    def _keys_from(self, page: int) -> list[int]:
        """Keys of the hittable pages from `page` on (hashed where not known yet)."""
        return self.chain.keys_upto(self.match_pages)[page:]

    def _start_prefetch(self, now_s: float, n: int) -> None:
        """Read the first n pages past the match (those storage holds) into host memory."""
        assert self.cache is not None and self.locked is not None
        if self.fetch_cap is not None:
            n = min(n, self.fetch_cap)
        want = self._after_match()[:n]
        self.prefetch = None
        if want:
            at = self.match.pages  # type: ignore[union-attr]
            tokens = self.chain.tokens(at, at + len(want))
            self.prefetch = self.cache.start_prefetch(
                want, self.locked, now_s, tokens, self.chain.seed, self.chain.width
            )
        self.state = LeaseState.PREFETCHING if self.prefetch else LeaseState.READY

    def _rematch(self) -> None:
        assert self.cache is not None
        if self.locked is not None:
            self.cache.unlock(self.locked)
        self.match = self.cache.match_chain(self.chain, self.match_pages)
        self.locked = self.match.last_node
        self.cache.lock(self.locked)  # type: ignore[arg-type]

    # ---- admission ----------------------------------------------------------------------------
    def admit(self) -> bool:
        """Own every device page the request needs and start the host -> device load, or nothing.

        False: device memory cannot hold it now (the caller retries at a later step, or gives up
        when nothing it runs can free pages); the lease stays READY and keeps its lock.
        """
        assert self.state is LeaseState.READY, f"admit in state {self.state.value}"
        if not self.can_ever_fit:
            return False  # evicting for it would only flush the cache
        if self.cache is None:
            assert self.allocator is not None
            ids = self.allocator.alloc(self.pages_needed)
            if ids is None:
                return False
            self.page_table = ids
        elif not self._admit_cached():
            return False
        self.state = LeaseState.ADMITTED
        return True

    def warm(self, max_load: int) -> None:
        """A prefetch hint, once READY: start the host -> device load of its matched host pages
        (at most `max_load`) where the device has room without taking a pinned or running
        page. No device page becomes the hint's and it counts as no request; it keeps its lock
        until `release` (once `load` is applied, or at once when nothing moves)."""
        assert self.state is LeaseState.READY and self.cache is not None, "warm a ready lease"
        m = self.match
        assert m is not None
        if 0 < m.host_pages <= max_load:
            self.load = self.cache.load_host(m, spare_pinned=True)

    @property
    def can_ever_fit(self) -> bool:
        """The request needs no more device pages than the pool has at all."""
        pool = self.cache.tiers.device if self.cache is not None else self.allocator
        assert pool is not None
        return self.pages_needed <= pool.capacity

    def _admit_cached(self) -> bool:
        cache, m = self.cache, self.match
        assert cache is not None and m is not None
        new = cache.alloc_device(self.pages_needed - m.pages)
        if new is None:
            return False
        load = cache.load_host(m)
        if load is None:
            cache.free_device(new)
            return False
        self.load = load
        self.page_table = m.device_ids + load.dst + new
        self.inserted = m.pages  # matched and loaded pages already belong to the tree
        storage = min(self.from_storage, m.host_pages)
        self.hits = Hits(m.device_pages, m.host_pages - storage, storage)
        cache.counters.record_request(self.match_pages, *self._hit_tuple())
        if m.last_node is not None and m.pages:
            cache.renew_pins(m.last_node)
        self._take_pins()
        return True

    def _hit_tuple(self) -> tuple[int, int, int]:
        return self.hits.device, self.hits.host, self.hits.storage

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens whose KV the cache provides (prefill starts here)."""
        return self.hits.pages * self.page

    # ---- while running ------------------------------------------------------------------------
    def extend_keys(self, more: list[int]) -> None:
        """Keys of further full pages (generated tokens) of a key-only chain."""
        self.chain.extend_keys(more)

    def extend_tokens(self, tokens: object, vocab_size: int | None = None) -> None:
        """Whole further pages of token ids (generated ones); hashed when committed."""
        self.chain.extend_tokens(tokens, vocab_size)

    def keep_private(self, first_page: int) -> None:
        """Pages [first_page, ...) serve this request only: never committed, freed at release."""
        bound = self.shared_below
        self.shared_below = first_page if bound is None else min(bound, first_page)

    def commit(self, computed_tokens: int) -> None:
        """Hand the full pages among the first `computed_tokens` to the tree (shared from now)."""
        n_full = min(computed_tokens // self.page, self.chain.pages, len(self.page_table))
        if self.shared_below is not None:
            n_full = min(n_full, self.shared_below)
        if self.cache is None or n_full <= self.inserted:
            return
        # the first `inserted` pages end at the locked node (matched, or committed before)
        below = self.cache.tree.root if self.locked is None else self.locked
        start = self.inserted
        node, ids = self.cache.insert_chain(
            self.chain, below, start, n_full, self.page_table[start:n_full]
        )
        self.cache.lock(node)
        if self.locked is not None:
            self.cache.unlock(self.locked)
        self.locked = node
        # a page another request cached first was freed by insert: use the tree's copy
        self.page_table[start:n_full] = ids
        self.inserted = n_full
        self._take_pins()

    def _take_pins(self) -> None:
        """Pin each wanted prefix whose whole pages the tree now holds (ending at `inserted`)."""
        if self.cache is None or not self.pin_specs:
            return
        while self.pin_specs and self.pin_specs[0].tokens // self.page <= self.inserted:
            spec = self.pin_specs.pop(0)
            pages = spec.tokens // self.page
            if pages and self.locked is not None:
                got = self.cache.pin(self.locked, pages, spec.ttl_s)
                self.pinned_pages = max(self.pinned_pages, got)

    def release(self) -> None:
        """Give back everything: unlock the prefix, free pages the tree did not take.

        Safe in any state (a request aborted while probing, prefetching or running). A
        prefetch still under way is stopped; its pages land (or not) at a later agreed step.
        """
        if self.state is LeaseState.RELEASED:
            return
        cache = self.cache
        if cache is None:
            if self.page_table:
                assert self.allocator is not None
                self.allocator.free(self.page_table)
        else:
            if self.prefetch is not None and self.prefetch.agreed is None:
                cache.stop_prefetch(self.prefetch)
            if self.locked is not None:
                cache.unlock(self.locked)
            if self.page_table[self.inserted :]:
                cache.free_device(self.page_table[self.inserted :])
        self.page_table = self.page_table[: self.inserted]
        self.locked = None
        self.state = LeaseState.RELEASED

"""Admission of waiting requests through the cache: match, L3 probe/prefetch, L2 load, L1 pages.

Every decision here depends only on agreed state (the tree, agreed op results, the agreed step
clock), so all ranks admit the same requests with the same pages in the same order. The head of
the queue is admitted first; a request that does not fit waits, and so do those behind it.
"""

from __future__ import annotations

import dataclasses

from kvstrata.cache.keys import Namespace, page_keys
from kvstrata.cache.manager import HiCache
from kvstrata.engine.request import Request, State
from kvstrata.memory.allocator import PageAllocator


class Admission:
    """Moves requests from waiting to prefill; owns the request <-> cache bookkeeping."""

    def __init__(
        self, cache: HiCache | None, allocator: PageAllocator, namespace: Namespace, vocab_size: int
    ) -> None:
        self.cache = cache
        self.allocator = allocator  # used directly only when the cache is off
        self.ns = namespace
        self.page = namespace.page_size
        self.vocab_size = vocab_size

    def advance(self, waiting: list[Request], now_s: float, slots: int) -> list[Request]:
        """Admit up to `slots` requests that fit, from the head of `waiting`."""
        admitted: list[Request] = []
        for i, req in enumerate(waiting):
            if not self._prepare(req, now_s, can_schedule=slots > 0 and i == 0):
                break
            if slots <= 0 or not self._admit(req):
                break
            admitted.append(req)
            slots -= 1
        return admitted

    def _ns(self, req: Request) -> Namespace:
        """The request's key namespace: its cache_salt joins the tenant salt (no shared pages)."""
        if not req.cache_salt:
            return self.ns
        return dataclasses.replace(
            self.ns, tenant_salt=f"{self.ns.tenant_salt}\x00{req.cache_salt}"
        )

    # ---- L3 ------------------------------------------------------------------------------------
    def _prepare(self, req: Request, now_s: float, can_schedule: bool) -> bool:
        """Run the match / probe / prefetch steps; True once the request may be admitted."""
        cache = self.cache
        if cache is None:
            return True
        if req.match is None:
            # the last prompt token is always computed, so its page is never a hit
            usable = (len(req.tokens) - 1) // self.page
            req.keys = page_keys(req.tokens[: usable * self.page], self._ns(req), self.vocab_size)
            self._rematch(req)
            req.probe = cache.start_probe(req.keys[req.match.pages :])  # type: ignore[union-attr]
            req.state = State.PROBING if req.probe is not None else State.WAITING
        if req.state is State.PROBING:
            if req.probe.agreed is None:  # type: ignore[union-attr]
                return False
            n = req.probe.agreed  # type: ignore[union-attr]
            start = req.match.pages  # type: ignore[union-attr]
            req.prefetch = (
                cache.start_prefetch(req.keys[start : start + n], req.locked, now_s) if n else None
            )
            req.state = State.PREFETCHING if req.prefetch is not None else State.WAITING
        if req.state is State.PREFETCHING:
            op = req.prefetch
            assert op is not None
            if op.agreed is None:
                if cache.prefetch_should_stop(op, now_s, can_schedule):
                    cache.stop_prefetch(op)
                return False
            req.l3_pages = op.agreed
            self._rematch(req)
            req.state = State.WAITING
        return True

    def _rematch(self, req: Request) -> None:
        assert self.cache is not None
        if req.locked is not None:
            self.cache.unlock(req.locked)
        req.match = self.cache.match(req.keys)
        req.locked = req.match.last_node
        self.cache.lock(req.locked)  # type: ignore[arg-type]

    # ---- L1 -------------------------------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        """Give the request every device page it needs (loads included), or nothing."""
        total = req.pages_needed(self.page)
        if self.cache is None:
            ids = self.allocator.alloc(total)
            if ids is None:
                return False
            req.page_table = ids
        else:
            m = req.match
            assert m is not None
            new = self.cache.alloc_device(total - m.pages)
            if new is None:
                return False
            load = self.cache.load_host(m)
            if load is None:
                self.cache.free_device(new)
                return False
            req.load = load
            req.page_table = m.device_ids + load.dst + new
            req.computed = m.pages * self.page
            req.hits = {"L1": m.device_pages, "L2": m.host_pages - req.l3_pages, "L3": req.l3_pages}
            self.cache.counters.record_request(
                len(req.keys), m.device_pages, m.host_pages - req.l3_pages, req.l3_pages
            )
        req.state = State.PREFILL
        return True

    # ---- completion -----------------------------------------------------------------------------
    def cache_pages(self, req: Request, final: bool) -> None:
        """Insert the request's full pages; at the end also release everything it holds."""
        if self.cache is None:
            if final:
                self.allocator.free(req.page_table)
            return
        n_full = req.computed // self.page
        keys = self._keys_upto(req, n_full)
        if keys:
            node = self.cache.insert(keys, req.page_table[:n_full])
            self.cache.lock(node)
            self.cache.unlock(req.locked)  # type: ignore[arg-type]
            req.locked = node
            # pages another request cached first were freed by insert: use the tree's copies
            req.page_table[:n_full] = self.cache.tree.match(keys, touch=False).device_ids
        if final:
            self.cache.unlock(req.locked)  # type: ignore[arg-type]
            req.locked = None
            self.cache.free_device(req.page_table[n_full:])
            req.page_table = req.page_table[:n_full]

    def _keys_upto(self, req: Request, n_pages: int) -> list[int]:
        """Page keys of the first n_pages of the request's tokens (prompt keys reused)."""
        keys = req.keys[:n_pages]
        if len(keys) < n_pages:
            parent = keys[-1] if keys else None
            more = req.all_tokens[len(keys) * self.page : n_pages * self.page]
            keys = keys + page_keys(more, self._ns(req), self.vocab_size, parent_key=parent)
            req.keys = keys
        return keys

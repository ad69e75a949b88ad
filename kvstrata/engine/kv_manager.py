"""The KV manager: the one owner of every request's cache lease (kvstrata.cache.lease).

It answers the scheduler's questions about pages: is a request's lease ready (matched, its
storage answer and prefetch done), can its device pages be had (`allocate`: all or nothing,
handing back an `Allocation` with what the tiers serve), and it commits computed pages, waits
for host -> device loads and gives everything back; nothing else sets or clears `req.lease`.
It changes no request's state: the scheduler decides who is admitted, preempted or ended, and
in what order (kvstrata/engine/scheduler.py holds the admission policy). The model runner asks
it which loads to wait for. It notes the pages each request has in the tree (committed, landed by
its prefetch, matched) with their tokens and salt (`take_cached`: the engine's StepResult carries
them to the KV event publisher).

Every answer here depends only on agreed state (the tree, agreed op results, the agreed step
clock), so all ranks admit the same requests with the same pages in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.cache.hicache import HiCache
from kvstrata.cache.keys import Namespace, page_keys, salted
from kvstrata.cache.lease import Hits, Lease
from kvstrata.cache.ops import PREFETCH, TransferOp
from kvstrata.engine.prefetch_hints import HintAnswer, PrefetchHints
from kvstrata.engine.request import Request
from kvstrata.engine.step_result import PagesCached
from kvstrata.memory.allocator import PageAllocator


@dataclass(frozen=True)
class Allocation:
    """What `allocate` hands back for an admitted request (its pages stay the lease's)."""

    hit_tokens: int  # leading prompt tokens the tiers serve: computed from the start
    pinned_pages: int  # the longest prefix its client pins kept at admission


class KVManager:
    """Owns every request's lease, from its first match until it ends."""

    def __init__(
        self,
        cache: HiCache | None,
        allocator: PageAllocator,
        namespace: Namespace,
        vocab_size: int,
    ) -> None:
        self.cache = cache
        self.allocator = allocator  # the lease allocates from it directly when the cache is off
        self.ns = namespace
        self.page = namespace.page_size
        self.vocab_size = vocab_size
        self.hints = (
            PrefetchHints(cache, vocab_size, cache.config.max_prefetch_pages)
            if cache is not None
            else None
        )
        self.cached: list[PagesCached] = []  # since the last take_cached
        self.noted: dict[str, int] = {}  # rid -> leading pages of its lease noted in `cached`
        self.prefetching: dict[TransferOp, PagesCached] = {}  # a request's prefetch: its pages

    # ---- admission (the scheduler's questions) --------------------------------------------------
    def begin_step(self, now_s: float) -> None:
        """The agreed step clock moves on: expired pins let go, prefetch hints advance."""
        if self.cache is not None:
            self.cache.tick(now_s)
        if self.hints is not None:
            self.hints.advance(now_s)

    def ready(self, req: Request, now_s: float, can_schedule: bool) -> bool:
        """Advance the waiting request's lease (opened on first ask): match, storage probe,
        prefetch under the policy; True once its pages may be allocated. may raise: the
        request's own lease work failed (it alone ends)."""
        lease = req.lease if req.lease is not None else self._open(req)
        try:
            return lease.advance(now_s, can_schedule=can_schedule)
        finally:
            self._note_prefix(req)
            self._note_prefetch(req)

    def probe_ahead(self, req: Request) -> TransferOp | None:
        """A request not asked `ready` yet asks storage now, before the step's agreement
        (Lease.probe_ahead; its lease is opened here); returns the probe put, if any. May
        raise as `ready` does: the request's `ready` then raises the same and fails it."""
        if req.lease is not None or self.cache is None or not self.cache.has_storage:
            return None
        return self._open(req).probe_ahead()

    def allocate(self, req: Request) -> Allocation | None:
        """Every device page a ready request needs, with the host -> device load of its host
        hits, or nothing at all (None: they cannot be had now)."""
        lease = req.lease
        assert lease is not None, f"request {req.rid} was never asked ready"
        if not lease.admit():
            return None
        return Allocation(lease.hit_tokens, lease.pinned_pages)

    def _open(self, req: Request) -> Lease:
        """The request's lease over the full pages of what it prefills (its prompt; after a
        preemption its output too), under its salted namespace, with the pins it entered with
        (the same on every rank)."""
        self.noted[req.rid] = 0
        req.lease = Lease.for_prompt(
            self.cache,
            req.prefill_tokens,
            self._ns(req),
            req.pages_needed(self.page),
            req.pins,
            self.vocab_size,
            self.allocator,
        )
        return req.lease

    # ---- keys -----------------------------------------------------------------------------------
    def prompt_keys(self, req: Request) -> list[int]:
        """Keys of the prompt's full pages under the request's namespace (pure: any thread)."""
        return self.seq_keys(req, req.tokens)

    def seq_keys(self, req: Request, seq: list[int]) -> list[int]:
        """Keys of the full pages of `seq` under the request's namespace (pure: any thread)."""
        n_full = len(seq) // self.page
        return page_keys(seq[: n_full * self.page], self._ns(req), self.vocab_size)

    def held_keys(self, req: Request) -> list[int]:
        """Keys of the prompt pages an admitted request's tiers served (device, host, storage
        prefetch)."""
        lease = req.lease
        assert lease is not None, f"request {req.rid} was never admitted"
        return lease.keys[: lease.hits.pages]

    def hits(self, req: Request) -> Hits:
        """Prompt pages each tier served an admitted request (none before admission)."""
        return req.lease.hits if req.lease is not None else Hits()

    def page_table(self, req: Request) -> list[int]:
        """Device page of each logical page of an admitted request."""
        assert req.lease is not None, f"request {req.rid} was never admitted"
        return list(req.lease.page_table)

    def copies_pending(self) -> bool:
        """Cache copies (device -> host stores, storage backups, loads) whose results are still to
        apply."""
        return self.cache is not None and len(self.cache.queues) > 0

    def holds(self, req: Request) -> bool:
        """The request holds pages (admitted, not released)."""
        return req.lease is not None

    def _ns(self, req: Request) -> Namespace:
        """The request's key namespace: its cache_salt joins the tenant salt (no shared pages)."""
        return salted(self.ns, req.cache_salt)

    # ---- prefetch hints (engine/prefetch_hints.py) ----------------------------------------------
    def hint(self, tokens: list[int], cache_salt: str, now_s: float) -> HintAnswer | None:
        """Start bringing these tokens' pages up the tiers (None: no cache)."""
        if self.hints is None:
            return None
        return self.hints.start(tokens, salted(self.ns, cache_salt), now_s)

    # ---- loads (host -> device, layer by layer) -------------------------------------------------
    def layer_wait(self, reqs: list[Request]) -> Callable[[int], None] | None:
        """Waits, per layer, for the loads of these requests not waited for yet; None: none."""
        loads = [r.lease.load.handle for r in reqs if _pending_load(r)]  # type: ignore[union-attr]
        if not loads:
            return None

        def wait_layer(layer: int) -> None:
            for (
                handle
            ) in loads:  # layer l's pages arrived from host memory before layer l reads them
                handle.wait_layer(layer)

        return wait_layer

    def loaded(self, reqs: list[Request]) -> None:
        """These requests' loads were waited for, layer by layer, in a forward."""
        for req in reqs:
            assert req.lease is not None
            req.lease.load = None

    def wait_loaded(self, req: Request, timeout_s: float) -> None:
        """Block until the request's whole host -> device load (if any is pending) has landed."""
        if _pending_load(req):
            req.lease.load.handle.wait(timeout_s)  # type: ignore[union-attr]

    # ---- commit and release ---------------------------------------------------------------------
    def cache_pages(self, req: Request, final: bool) -> None:
        """Share the request's full computed pages; at the end release everything it holds."""
        lease = req.lease
        assert lease is not None, f"request {req.rid} was never admitted"
        ready = req.final_kv_tokens  # under speculation: target and draft KV both final
        n_full = ready // self.page
        have = lease.chain.pages
        if self.cache is not None and n_full > have:
            lease.extend_tokens(
                req.all_tokens[have * self.page : n_full * self.page], self.vocab_size
            )
        lease.commit(ready)
        self._note_prefix(req)
        req.pinned_pages = max(req.pinned_pages, lease.pinned_pages)
        if final:
            lease.release()

    def preempt(self, req: Request) -> None:
        """Give the request's pages back (its full computed ones stay cached) and forget its
        lease: readmitted, it matches afresh (vLLM's recompute preemption)."""
        self.cache_pages(req, final=True)
        req.lease = None

    def release(self, req: Request) -> None:
        """A waiting request lets go of its locks and prefetches; it matches again later."""
        if req.lease is not None:
            req.lease.release()
            req.lease = None

    def free(self, req: Request) -> None:
        """A request that ended (or is aborted, in any state) gives back every page and lock at
        once: its committed pages stay in the tree, unlocked (evictable); the rest is freed."""
        if req.lease is not None:
            req.lease.release()
        self.noted.pop(req.rid, None)

    # ---- what the tree's pages hold (for KV events) ----------------------------------------------
    def take_cached(self) -> list[PagesCached]:
        """The pages noted since the last take, in the order noted."""
        out, self.cached = self.cached, []
        return out

    def landed(self, applied: list[TransferOp]) -> None:
        """Agreed cache moves were applied: a request's prefetch put its landed pages in the tree."""
        for op in applied:
            pages = self.prefetching.pop(op, None) if op.kind == PREFETCH else None
            if pages is not None and op.agreed:
                n = op.agreed
                self.cached.append(
                    PagesCached(pages.keys[:n], pages.tokens[: n * self.page], pages.salt)
                )

    def _note_prefix(self, req: Request) -> None:
        """Note the leading pages the request's lease has in the tree (matched, committed)."""
        lease = req.lease
        if self.cache is None or lease is None:
            return
        held = max(lease.inserted, lease.match.pages if lease.match is not None else 0)
        held = min(held, len(lease.keys))  # every page in the tree has its key known
        done = self.noted.get(req.rid, 0)
        if held > done:
            self.cached.append(self._pages(req, lease.keys[done:held], done))
            self.noted[req.rid] = held

    def _note_prefetch(self, req: Request) -> None:
        """Remember the pages a prefetch the request's lease started will land."""
        lease = req.lease
        if lease is None or lease.prefetch is None:
            return
        op = lease.prefetch
        if op.agreed is None and op not in self.prefetching:
            first = lease.match.pages if lease.match is not None else 0
            self.prefetching[op] = self._pages(req, op.keys, first)

    def _pages(self, req: Request, keys: list[int], first: int) -> PagesCached:
        """The request's pages [first, first + len(keys)) under these keys."""
        lo, hi, n = first * self.page, (first + len(keys)) * self.page, len(req.tokens)
        tokens = req.tokens[lo:hi] + req.output[max(0, lo - n) : max(0, hi - n)]
        return PagesCached(list(keys), tokens, req.cache_salt)

    # ---- prefix-cache reset ---------------------------------------------------------------------
    def reset_prefix(self, drop_host: bool) -> bool:
        """Forget every cached device page (drop_host: host too; never storage). The caller
        preempted or released every lease and applied every pending copy first."""
        return self.cache.reset_prefix(drop_host) if self.cache is not None else True


def _pending_load(req: Request) -> bool:
    """The request's host -> device copy has not been waited for yet."""
    lease = req.lease
    return lease is not None and lease.load is not None and lease.load.handle is not None

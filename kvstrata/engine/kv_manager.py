"""The KV manager: the one owner of every request's cache lease (kvstrata.cache.lease).

It opens a request's lease, advances it to admission, commits its computed pages, waits for its
host -> device loads and gives everything back; nothing else sets or clears `req.lease`. The
scheduler asks it to admit, preempt, reset and abort; the model runner asks it which loads to wait
for.

Every decision here depends only on agreed state (the tree, agreed op results, the agreed step
clock), so all ranks admit the same requests with the same pages in the same order.

No head-of-line blocking: the first `lookahead` waiting requests advance their leases (match,
storage probe, prefetch) at once; a request still waiting on storage is passed over, and the ready
ones behind it are admitted in arrival order while slots and pages last. Among ready requests
admission stays first come first served: a ready request that does not fit stops the scan, so a
large request is not starved by small ones behind it, and the leases behind it let go of their
locks so they cannot keep it out for ever.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.cache.chain import PageChain
from kvstrata.cache.keys import Namespace, page_keys, salted
from kvstrata.cache.lease import Hits, Lease
from kvstrata.cache.manager import HiCache
from kvstrata.engine.prefetch_hints import HintAnswer, PrefetchHints
from kvstrata.engine.request import Request, State
from kvstrata.memory.allocator import PageAllocator


class KVManager:
    """Moves requests from waiting to prefill and owns their leases until they end."""

    def __init__(
        self,
        cache: HiCache | None,
        allocator: PageAllocator,
        namespace: Namespace,
        vocab_size: int,
        lookahead: int = 4,
    ) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.cache = cache
        self.allocator = allocator  # the lease allocates from it directly when the cache is off
        self.ns = namespace
        self.page = namespace.page_size
        self.vocab_size = vocab_size
        self.lookahead = lookahead
        self.hints = (
            PrefetchHints(cache, vocab_size, cache.config.max_prefetch_pages)
            if cache is not None
            else None
        )

    # ---- admission ------------------------------------------------------------------------------
    def advance(
        self,
        waiting: list[Request],
        now_s: float,
        slots: int,
        failed: dict[str, str] | None = None,
    ) -> list[Request]:
        """Admit up to `slots` ready requests that fit, in arrival order (see module doc).
        failed: rid -> why, for requests whose own lease work raised (the caller ends them)."""
        if self.cache is not None:
            self.cache.tick(now_s)  # the agreed step clock: expired pins let go
        if self.hints is not None:
            self.hints.advance(now_s)
        admitted: list[Request] = []
        window = waiting[: self.lookahead]
        for i, req in enumerate(window):
            try:
                lease = req.lease if req.lease is not None else self._open(req)
                ready = lease.advance(now_s, can_schedule=slots > 0)
            except Exception as exc:  # noqa: BLE001 - one request's lease fails alone
                if failed is None:
                    raise
                failed[req.rid] = f"{type(exc).__name__}: {exc}"
                continue
            if not ready:
                continue  # waiting on storage: the ready requests behind it go first
            if slots <= 0:
                break
            if not lease.admit():
                self._step_back(window[i + 1 :])
                break
            req.computed = lease.hit_tokens
            req.pinned_pages = max(req.pinned_pages, lease.pinned_pages)
            req.state = State.PREFILL
            admitted.append(req)
            slots -= 1
        return admitted

    def _step_back(self, behind: list[Request]) -> None:
        """The first ready request does not fit: the leases behind it give back their locks
        (and stop their prefetches), so the pages they pinned can make room for it. They match
        again from scratch at a later step; without this, waiting leases that lock each other's
        room would wait for ever."""
        for req in behind:
            self.release(req)

    def _open(self, req: Request) -> Lease:
        """The request's lease over the full pages of what it prefills (its prompt): their
        token bytes, validated here; a page is hashed only once its key is needed (the lease's
        storage probe, its commit), so the pages the tree already holds never are."""
        seq = req.prefill_tokens
        req.lease = Lease(
            self.cache,
            PageChain.from_tokens(seq, self._ns(req), self.vocab_size),
            len(seq),
            req.pages_needed(self.page),
            self.page,
            allocator=self.allocator,
        )
        req.lease.want_pins(req.pins)  # they enter with the request: the same on every rank
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
        req.pinned_pages = max(req.pinned_pages, lease.pinned_pages)
        if final:
            lease.release()

    def preempt(self, req: Request) -> None:
        """Back to waiting, its pages given back (the full ones stay cached): readmitted, it
        recomputes its prompt and the tokens it made so far (vLLM's recompute preemption)."""
        self.cache_pages(req, final=True)
        req.lease, req.computed, req.draft_computed = None, 0, None
        req.state = State.WAITING

    def release(self, req: Request) -> None:
        """A waiting request lets go of its locks and prefetches; it matches again later."""
        if req.lease is not None:
            req.lease.release()
            req.lease = None

    def abort(self, req: Request) -> None:
        """Drop a request in any state: its lease gives back every page and lock at once."""
        if req.lease is not None:
            req.lease.release()
        req.state = State.DONE


def _pending_load(req: Request) -> bool:
    """The request's host -> device copy has not been waited for yet."""
    lease = req.lease
    return lease is not None and lease.load is not None and lease.load.handle is not None

"""The connector's KV manager (it runs in vLLM's scheduler process): vLLM's prefix hit is the
device tier; kvstrata's cache manager adds host/storage.

One HiCache over three tiers decides everything: its device tier holds *transit* pages (a
transit id names the vLLM blocks of one page of a running request, bound in JobMover), its host
tier is the workers' host pools (same ids on every worker), its storage tier the backend the
workers open. Each vLLM request drives one Lease, as our own engine's admission does:

    get_num_new_matched_tokens: open the lease, advance it (match, storage probe, prefetch under the
        policy); while it waits on storage the answer is "ask again" and vLLM schedules others;
        ready: the tokens past vLLM's own hit that the match holds in host memory (storage pages
        landed in host memory)
    update_state_after_alloc: admit (transit pages + the host -> vLLM load), bind transit ids
    build_connector_meta: commit the full pages this step computes (insert -> write-through
        store, which the workers run after the forward), then ship the step's jobs
    update_connector_output: the workers' agreed results; a backup every worker wrote gets its
        storage commit markers here (the only writer of markers: JobMover)
    request_finished: release, then evict the request's pages no other lease holds under the
        write policy (the manager's rule: drop where a host copy exists; write_back demotes them,
        a store that reads the request's blocks: vLLM keeps them (delay_free) until the workers
        report the request in finished_sending, after the next step's stores ran)

write_through copies a page in the step that computed it; write_back when its request ends;
write_through_selective once the page was hit `write_through_threshold` times while some running
request holds it (vLLM's own prefix hits happen in blocks kvstrata does not see, so a page hit
only there is never counted). A store reads the blocks of a request that holds the page's KV
(JobMover.bind_source); a request vLLM preempts or frees is forgotten first, so no store ever
reads a block vLLM may have reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.hicache import HiCache
from kvstrata.cache.keys import Namespace, salted
from kvstrata.cache.lease import Lease, LeaseState
from kvstrata.cache.radix import Match, Node
from kvstrata.integrations.vllm.config import VllmConnectorConfig
from kvstrata.integrations.vllm.metadata import StepJobs
from kvstrata.integrations.vllm.mover import JobMover
from kvstrata.integrations.vllm.pins import pins_from_params
from kvstrata.integrations.vllm.spec import KVSpec
from kvstrata.integrations.vllm.tier_events import TierChange, TierEvents
from kvstrata.memory.allocator import PageAllocator
from kvstrata.storage.base import StorageConfig
from kvstrata.storage.units import PagePart, UnitStorage, open_unit_storage

TRANSIT_PAGES = 1 << 16
"""Transit ids: far more than any vLLM KV space holds pages, so transit allocation never evicts
(an eviction would demote a transit page whose vLLM block may be gone)."""


@dataclass
class RequestState:
    """What the connector keeps of one vLLM request between its calls."""

    request: Any  # vllm.v1.request.Request (live: its token ids grow)
    lease: Lease
    blocks: list[int] = field(default_factory=list)  # the request's vLLM block ids, in order
    vllm_hit: int = 0  # tokens vLLM's own prefix cache provided at admission
    external: int = 0  # tokens this connector told vLLM it loads
    fresh: bool = False  # admitted this step: `blocks` already lists every block it has
    valid: int = 0  # tokens whose KV the request's blocks hold by the end of this step
    sources: dict[str, int] = field(default_factory=dict)  # external tokens by tier (admitted)


class VllmKVManager:
    """Drives one HiCache for every request vLLM schedules (see module doc)."""

    def __init__(self, config: VllmConnectorConfig, spec: KVSpec, kv_events: bool = False) -> None:
        self.spec = spec
        self.page = spec.page_size
        self.ratio = spec.page_size // spec.block_size
        host_pages = config.resolved_host_pages(spec.page_nbytes)
        cache_config = CacheConfig(
            page_size=spec.page_size,
            device_pages=TRANSIT_PAGES,
            host_pages=host_pages,
            storage_url=config.storage_url,
            eviction=config.eviction,
            write_policy=config.write_policy,
            write_through_threshold=config.write_through_threshold,
            prefetch_policy=config.prefetch_policy,
            prefetch_timeout_base_s=config.prefetch_timeout_base_s,
            prefetch_timeout_per_page_s=config.prefetch_timeout_per_page_s,
            results_per_step=64,
        )
        self.storage = _marker_store(config, spec)
        self.mover = JobMover(self.storage.commit if self.storage is not None else None)
        self.cache = HiCache(
            cache_config,
            PageAllocator(TRANSIT_PAGES),
            PageAllocator(host_pages),
            self.mover,
            has_storage=bool(config.storage_url),
            page_nbytes=spec.page_nbytes,
        )
        self.ns = Namespace(
            model_fingerprint=spec.fingerprint,
            kv_dtype=spec.dtype,
            tenant_salt=config.tenant_salt,
            page_size=spec.page_size,
        )
        self.requests: dict[str, RequestState] = {}
        self.events = TierEvents(spec.page_size) if kv_events else None  # vLLM publishes events
        self.load_errors: set[int] = set()
        self.leaving: set[str] = set()  # finished, blocks kept for stores the next step runs
        self.check_each_step = config.check_integrity
        self.hit_tokens = {
            "host": 0,
            "storage": 0,
        }  # tokens vLLM took from each tier, since last taken

    # ---- vLLM's scheduler calls ---------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        self._step()
        st = self.requests.get(request.request_id)
        if st is not None and st.lease.state is LeaseState.ADMITTED:
            self._preempted(st)  # vLLM freed its blocks and schedules it afresh
            st = None
        if st is None or st.lease.state is LeaseState.RELEASED:
            st = self.requests[request.request_id] = RequestState(request, self._open(request))
        if not st.lease.advance(time.monotonic(), can_schedule=True):
            return None, False  # storage still answering or prefetching: vLLM runs others meanwhile
        assert st.lease.match is not None
        st.vllm_hit = num_computed
        st.external = self._loadable(st.lease.match, num_computed)
        return st.external, False

    def _open(self, request: Any) -> Lease:
        """The request's lease over its prompt, under its salted namespace (kvstrata's own
        engine opens its requests' leases the same way: Lease.for_prompt, keys.salted)."""
        prompt = list(request.prompt_token_ids)
        max_tokens = int(getattr(request, "max_tokens", 0) or 0)
        params = getattr(request, "kv_transfer_params", None)
        return Lease.for_prompt(
            self.cache,
            prompt,
            salted(self.ns, getattr(request, "cache_salt", None) or ""),
            -(-(len(prompt) + max_tokens) // self.page),
            pins_from_params(params, len(prompt), request.request_id),
        )

    def _loadable(self, m: Match, num_computed: int) -> int:
        """Tokens past vLLM's hit that host memory provides: the match, unless a page past vLLM's
        hit is only a transit copy (another running request's blocks, which vLLM did not share)."""
        if m.device_pages * self.page > num_computed:
            return 0
        return max(0, m.pages * self.page - num_computed)

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external: int
    ) -> None:
        st = self.requests.get(request.request_id)
        if st is None or st.lease.state is not LeaseState.READY:
            return
        st.blocks = list(block_ids)
        st.fresh = True
        if not st.lease.admit():
            if num_external:  # we promised tokens we cannot load: vLLM recomputes them
                first = st.vllm_hit // self.spec.block_size
                last = (st.vllm_hit + num_external) // self.spec.block_size
                self.load_errors.update(st.blocks[first:last])
            st.lease.release()
            return
        st.valid = st.vllm_hit + st.external  # loads land before this step's forward
        self._bind(st)
        from_storage = min(num_external, st.lease.hits.storage * self.page)
        st.sources = {"host": num_external - from_storage, "storage": from_storage}
        for tier, n in st.sources.items():
            self.hit_tokens[tier] += n

    def _bind(self, st: RequestState) -> None:
        """Bind each transit page of the request to its vLLM blocks: a load writes only the
        blocks of the loaded range (-1 elsewhere); a store may read the blocks of every page
        whose KV they hold by the end of this step (`st.valid` tokens)."""
        block, rid = self.spec.block_size, st.request.request_id
        load_lo, load_hi = st.vllm_hit // block, (st.vllm_hit + st.external) // block
        n_blocks = len(st.blocks)
        for i, transit in enumerate(st.lease.page_table):
            span = range(i * self.ratio, (i + 1) * self.ratio)
            load = [st.blocks[b] if load_lo <= b < load_hi and b < n_blocks else -1 for b in span]
            self.mover.bind_load(transit, tuple(load), rid)
            if span[-1] < n_blocks and (i + 1) * self.page <= st.valid:
                self.mover.bind_source(transit, tuple(st.blocks[b] for b in span), rid)

    def _step(self) -> None:
        """Apply finished copies; client pins past their deadline let go (one scheduler process
        decides: its clock is the step clock)."""
        self.cache.step()
        self.cache.tick(time.monotonic())

    def build_connector_meta(self, scheduler_output: Any) -> StepJobs:
        self._step()
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self.requests.get(req_id)
            if st is not None and st.lease.state is LeaseState.ADMITTED and not st.fresh:
                self._preempted(st)  # its blocks are free again: forget them before any job
                del self.requests[req_id]
        for req_id, new_blocks in _new_blocks(scheduler_output):
            st = self.requests.get(req_id)
            if st is not None and st.lease.state is LeaseState.ADMITTED:
                if not st.fresh and new_blocks:
                    st.blocks.extend(new_blocks)
                    self._bind(st)
                st.fresh = False
        for req_id, upto in _computed_after_step(scheduler_output):
            st = self.requests.get(req_id)
            if st is not None and st.lease.state is LeaseState.ADMITTED:
                self._commit(st, upto)
        self._drop_transit()
        if self.events is not None:  # the token ids of every page a live lease knows
            for st in self.requests.values():
                self.events.record(
                    st.lease.keys,
                    st.request.all_token_ids,
                    salt=getattr(st.request, "cache_salt", None) or "",
                )
        jobs = self.mover.take_jobs()
        jobs.failed_blocks = sorted(self.load_errors)
        self.load_errors.clear()
        jobs.finished_sending = sorted(self.leaving)  # no later job reads their blocks
        for req_id in self.leaving:
            self.mover.forget(req_id)
        self.leaving.clear()
        if self.check_each_step:
            self.check_integrity()
        return jobs

    def _commit(self, st: RequestState, upto: int) -> None:
        """Full pages computed by the end of this step join the tree (write-through stores)."""
        lease = st.lease
        n_full = min(upto // self.page, len(st.blocks) // self.ratio)
        have = lease.chain.pages
        if n_full > have:
            tokens = list(st.request.all_token_ids)[have * self.page : n_full * self.page]
            lease.extend_tokens(tokens)
        lease.commit(n_full * self.page)
        grew = upto // self.page > st.valid // self.page
        st.valid = max(st.valid, upto)  # this step's forward writes them before its stores run
        if grew:
            self._bind(st)

    def _drop_transit(self) -> None:
        """Forget transit copies no lease holds (leaves first): vLLM may reuse their blocks. A
        client pin keeps the host copy only (a transit copy names blocks vLLM owns)."""
        tiers = self.cache.tiers
        for node in reversed(list(self.cache.tree.nodes())):
            if node.device is None or node.busy or node.has_device_child():
                continue
            if node.host is not None or not node.children:
                tiers.drop_device(node)

    def request_finished(self, request: Any) -> bool:
        """Release the request's lease and evict what no other lease holds under the write
        policy. True: a store still reads its blocks (vLLM keeps them until finished_sending)."""
        rid = request.request_id
        self.cache.step()  # stores that already landed: their pages need no copy now
        st = self.requests.pop(rid, None)
        if st is None:
            return False
        lease = st.lease
        path = _path(lease.locked, self.cache.tree.root)
        if lease.state is LeaseState.ADMITTED:
            st.valid = max(st.valid, request.num_computed_tokens)
            self._bind(st)  # the store of an evicted page reads this request's blocks
            self.mover.unbind(lease.page_table[lease.inserted :])  # freed by release
        lease.release()
        for node in path:  # leaves first
            if node.device is not None and not node.busy and not node.has_device_child():
                self.cache.tiers.evict_node(node)
        if self.mover.reads(rid):
            self.leaving.add(rid)
            return True
        self.mover.forget(rid)
        return False

    def _preempted(self, st: RequestState) -> None:
        """vLLM took the request's blocks back: forget them, then let go of its pages."""
        self.mover.forget(st.request.request_id)
        self.mover.unbind(st.lease.page_table[st.lease.inserted :])
        st.lease.release()

    def hit_sources(self, request_id: str) -> dict[str, int]:
        """The admitted request's external tokens by tier ({} if it was not admitted)."""
        st = self.requests.get(request_id)
        return {t: n for t, n in st.sources.items() if n} if st is not None else {}

    def take_tier_changes(self) -> list[TierChange]:
        """Host / storage pages stored or removed since the last take (none without events)."""
        return self.events.take(self.cache.tree) if self.events is not None else []

    def take_hit_tokens(self) -> dict[str, int]:
        out, self.hit_tokens = self.hit_tokens, {"host": 0, "storage": 0}
        return out

    def report(self, results: dict[int, int]) -> None:
        self.mover.report(results)

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        if self.storage is not None:
            self.storage.check_integrity()

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()


def _marker_store(config: VllmConnectorConfig, spec: KVSpec) -> UnitStorage | None:
    """The store seen whole (every layer and head): the scheduler side only writes its commit
    markers, the workers write the units."""
    if not config.storage_url:
        return None
    full = spec.full_shape
    whole = PagePart(full, (0, full.num_layers), (0, full.num_kv_heads))
    return open_unit_storage(
        config.storage_url, whole, StorageConfig(), commit_on_put=False, layout=spec.units
    )


def _path(node: Node | None, root: Node) -> list[Node]:
    """`node` and its ancestors below the root, deepest first."""
    out = []
    while node is not None and node is not root:
        out.append(node)
        node = node.parent
    return out


def _new_blocks(out: Any) -> list[tuple[str, list[int]]]:
    """(request id, vLLM blocks newly given to it this step) for every scheduled request."""
    pairs = [(r.req_id, list(r.block_ids[0])) for r in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        blocks = cached.new_block_ids[i]
        pairs.append((req_id, list(blocks[0]) if blocks else []))
    return pairs


def _computed_after_step(out: Any) -> list[tuple[str, int]]:
    """(request id, tokens whose KV exists once this step's forward ran)."""
    pairs = [
        (r.req_id, r.num_computed_tokens + out.num_scheduled_tokens.get(r.req_id, 0))
        for r in out.scheduled_new_reqs
    ]
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        upto = cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0)
        pairs.append((req_id, upto))
    return pairs

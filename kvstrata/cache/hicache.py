"""The hierarchical cache manager: tree + tiers + policies + counted asynchronous moves.

Tensor-free. Its request-path calls (match, lock, start_probe, start_prefetch, load_host,
alloc_device, insert, ...) are the building blocks of `kvstrata.cache.lease.Lease`, the one
object that strings them together for a request; nothing else should. The driver calls `step()`
(or `local_progress()` -> agree -> `apply()` under several ranks) once per scheduler step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvstrata.cache import integrity
from kvstrata.cache.chain import PageChain
from kvstrata.cache.config import CacheConfig
from kvstrata.cache.counters import CacheCounters
from kvstrata.cache.ops import BACKUP, LOAD, PREFETCH, PROBE, STORE, OpQueues, PageMover, TransferOp
from kvstrata.cache.pins import PinBook
from kvstrata.cache.policies import EVICTION, WRITE, PrefetchState
from kvstrata.cache.policies import PREFETCH as PREFETCH_POLICIES
from kvstrata.cache.radix import Match, Node, RadixTree
from kvstrata.cache.tiers import Allocator, Tiers, host_copy_spared


class HiCache:
    """One logical prefix cache over device, host and storage (through the mover)."""

    def __init__(
        self,
        config: CacheConfig,
        device: Allocator,
        host: Allocator | None,
        mover: PageMover,
        has_storage: bool = False,
        page_nbytes: int = 0,
    ) -> None:
        if device.capacity != config.device_pages:
            raise ValueError(
                f"device allocator holds {device.capacity} pages, config.device_pages "
                f"is {config.device_pages}"
            )
        if (host.capacity if host else 0) != config.host_pages:
            raise ValueError(f"host allocator does not match config.host_pages={config.host_pages}")
        self.config = config
        self.tree = RadixTree()
        self.mover = mover
        self.has_storage = has_storage and host is not None
        self.write = WRITE.create(config.write_policy, config.write_through_threshold)
        self.stop_rule = PREFETCH_POLICIES.create(
            config.prefetch_policy,
            config.prefetch_timeout_base_s,
            config.prefetch_timeout_per_page_s,
        )
        self.counters = CacheCounters(config.page_size, page_nbytes)
        self.tiers = Tiers(
            self.tree,
            device,
            host,
            EVICTION.create(config.eviction),
            self.write,
            self.counters,
            self._demote,
        )
        self.queues = OpQueues(config.results_per_step)
        # client pins: within pin_budget of the host pool (the device one without a host tier)
        pool = config.host_pages if host is not None else config.device_pages
        self.pins = PinBook(
            self.tree,
            int(config.pin_budget * pool),
            int(config.pin_device_share * config.device_pages),
            self.tiers.touched,
            self.counters.pins,
        )
        self.tiers.pins = self.pins
        self.owned: set[int] = set()  # device pages held by running requests, not in the tree
        self.resets = 0  # prefix-cache resets so far (agreed: every rank resets at one step)

    # ---- request path -------------------------------------------------------------------------
    def match(self, keys: list[int]) -> Match:
        """Longest cached prefix; backs up hot pages under write_through_selective."""
        return self._matched(self.tree.match(keys))

    def peek(self, keys: list[int]) -> Match:
        """`match` that changes no recency, hit count or backup: what a router looking at this
        cache sees (a partially matched edge may still be split, holding the same pages)."""
        return self.tree.match(keys, touch=False)

    def peek_chain(self, chain: PageChain, n_pages: int) -> Match:
        """`peek` of a chain's first n_pages, by token bytes (as `match_chain` finds them)."""
        return self.tree.match_chain(chain, n_pages, touch=False)

    def match_chain(self, chain: PageChain, n_pages: int) -> Match:
        """`match` of a chain's first n_pages, by token bytes: only pages the tree does not
        hold may get hashed (see RadixTree.match_chain)."""
        return self._matched(self.tree.match_chain(chain, n_pages))

    def _matched(self, m: Match) -> Match:
        if self.write.hit_threshold and self.tiers.host is not None:
            # the host room a backup takes must not come from the path just matched
            self.tree.lock(m.last_node)  # type: ignore[arg-type]
            node = m.device_node
            while node is not None and node is not self.tree.root:
                if node.hits >= self.write.hit_threshold:
                    self._store(node)
                node = node.parent
            self.tree.unlock(m.last_node)  # type: ignore[arg-type]
        return m

    def lock(self, node: Node) -> None:
        self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)
        self.tiers.touched(node)

    def alloc_device(self, n: int) -> list[int] | None:
        """n device pages owned by the caller until inserted or freed; None: wait and retry."""
        ids = self.tiers.alloc_device(n)
        if ids is not None:
            self.owned.update(ids)
        return ids

    def free_device(self, ids: list[int]) -> None:
        self.owned.difference_update(ids)
        self.tiers.device.free(ids)

    def load_host(self, m: Match, spare_pinned: bool = False) -> TransferOp | None:
        """Give the match's host-only pages device pages and start the host -> device copy.

        The caller has locked m.last_node. Returns None (try later) when device memory is too full
        (spare_pinned: too full of pages that are neither pinned nor in use; a prefetch hint).
        """
        n = m.host_pages
        if n == 0:
            return TransferOp(LOAD, [], [], agreed=0)  # nothing to move: already done
        src = [h for node in m.host_nodes for h in node.host]  # type: ignore[union-attr]
        ids = self.tiers.alloc_device(n, src, spare_pinned)  # same owner as the host copy (cp)
        if ids is None:
            return None
        at = 0
        for node in m.host_nodes:
            assert node.host is not None and node.device is None
            node.pins += 1  # the copy writes these device pages until it is applied
            node.device = ids[at : at + len(node)]
            at += len(node)
            self.tiers.touched(node)
        op = TransferOp(LOAD, src, ids, node=m.last_node)
        self._submit(op)
        return op

    def insert_chain(
        self, chain: PageChain, below: Node, start: int, stop: int, device_ids: list[int]
    ) -> tuple[Node, list[int]]:
        """`insert` of a chain's pages [start, stop) with their token bytes, below `below` (the
        locked node that ends the chain's first `start` pages); hashes only the pages whose
        keys the chain does not know yet. Returns (last node, the tree's device ids of those
        pages: the caller's, except where another request cached a page first)."""
        assert self.tree.depth(below) == start, "`below` must end the chain's first pages"
        keys = chain.keys_upto(stop)[start:]
        tokens = chain.tokens(start, stop)
        node = self.insert(keys, device_ids, tokens, chain.seed, below, chain.width)
        parts, walk = [], node
        while walk is not below:  # the nodes under `below` the insert walked (one or a few)
            assert walk is not None and walk.device is not None
            parts.append(walk.device)
            walk = walk.parent
        return node, [i for part in reversed(parts) for i in part]

    def insert(
        self,
        keys: list[int],
        device_ids: list[int],
        tokens: bytes | None = None,
        seed: int = 0,
        below: Node | None = None,
        width: int = 4,
    ) -> Node:
        """Cache full pages the caller computed (or matched); ownership of the ids passes to the
        tree. tokens/seed/below/width: as RadixTree.insert takes them."""
        node, spare = self.tree.insert(keys, device_ids, tokens, seed, below, width)
        self.owned.difference_update(device_ids)
        if spare:
            self.tiers.device.free(spare)
        self.tiers.touched(node)
        if self.write.on_insert and self.tiers.host is not None:
            walk: Node | None = node
            while walk is not None and walk is not self.tree.root and walk.host is None:
                if not host_copy_spared(walk):  # it may have given its host copy up
                    self._store(walk)
                walk = walk.parent
        return node

    # ---- client pins (cache/pins.py) ---------------------------------------------------------
    def tick(self, now_s: float) -> None:
        """Once per step, with the agreed step clock: pins past their deadline let go."""
        self.pins.tick(now_s)

    def pin(self, end: Node, pages: int, ttl_s: float) -> int:
        """Keep the first `pages` pages of the path that ends at `end` (which the caller holds
        locked) for ttl_s of the step clock; returns the pages pinned (0: refused)."""
        return self.pins.pin_at(end, pages, ttl_s)

    def renew_pins(self, end: Node) -> None:
        """The path ending at `end` was used: the pins on it start their TTL again."""
        if self.pins.pins:
            self.pins.renew_path(end)

    # ---- storage probe and prefetch -----------------------------------------------------------
    def start_probe(self, keys: list[int]) -> TransferOp | None:
        """Ask storage how many leading `keys` it holds; the agreed answer lands in op.agreed."""
        if not self.has_storage or not keys:
            return None
        op = TransferOp(PROBE, [], [], keys=list(keys))
        self._submit(op)
        return op

    def start_prefetch(
        self,
        keys: list[int],
        parent: Node,
        now_s: float = 0.0,
        tokens: bytes | None = None,
        seed: int = 0,
        width: int = 4,
    ) -> TransferOp | None:
        """Read the leading pages of `keys` that storage has into host memory, under `parent`
        (tokens/seed/width: their token bytes, which the landed pages take into the tree)."""
        if not self.has_storage or not keys:
            return None
        host_ids = self.tiers.alloc_host_upto(len(keys))
        self.counters.prefetch_no_room_pages += len(keys) - len(host_ids)
        if not host_ids:
            return None
        if len(host_ids) < len(keys):  # the leading pages that fit: each one is not computed
            if tokens is not None:
                tokens = tokens[: len(host_ids) * (len(tokens) // len(keys))]
            keys = keys[: len(host_ids)]
        parent.pins += 1
        op = TransferOp(PREFETCH, [], host_ids, keys=list(keys), node=parent, started_s=now_s)
        op.tokens, op.seed, op.width = tokens, seed, width
        self._submit(op)
        return op

    def await_answers(self, probes: list[TransferOp], timeout_s: float) -> None:
        """Wait up to timeout_s for this rank's answers to these probes (before the step's
        agreement reads them: an answer that comes in time is applied in this step)."""
        deadline = time.monotonic() + timeout_s
        for op in probes:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.mover.wait_answered(op, left)

    def prefetch_should_stop(self, op: TransferOp, now_s: float, can_schedule: bool) -> bool:
        """The policy's verdict from agreed inputs; the caller then calls stop_prefetch."""
        state = PrefetchState(len(op.keys), now_s - op.started_s, can_schedule)
        return op.agreed is None and self.stop_rule(state)

    def stop_prefetch(self, op: TransferOp) -> None:
        if not op.cancelled:
            op.cancelled = True
            self.counters.prefetch["stopped"] += 1
            self.mover.cancel(op)

    # ---- steps --------------------------------------------------------------------------------
    def local_progress(self) -> list[int]:
        """This rank's view of pending completions, to be agreed (min) across ranks."""
        return self.queues.local_progress(self.mover)

    def apply(self, agreed: list[int]) -> list[TransferOp]:
        """Apply exactly the agreed completions, in order. Returns the applied ops."""
        applied = []
        for op, ok in self.queues.take_agreed(agreed):
            op.agreed = ok
            if op.kind != PROBE:
                self.counters.record_move(op.kind, op.pages, ok, op.written_bytes)
            {
                LOAD: self._load_done,
                STORE: self._store_done,
                BACKUP: self._backup_done,
                PROBE: _noop,
                PREFETCH: self._prefetch_done,
            }[op.kind](op, ok)
            self.mover.release(op)
            applied.append(op)
        self.tiers.compact()
        return applied

    def step(self) -> list[TransferOp]:
        """One rank alone: its local progress is the agreed progress."""
        return self.apply(self.local_progress())

    def drain(
        self,
        agree: Callable[[list[int]], list[int]] | None = None,
        timeout_s: float = 600.0,
        what: str = "cache ops",
    ) -> list[TransferOp]:
        """Apply every pending op: the one drain loop (shutdown, a prefix-cache reset, tests);
        returns the applied ops in the order applied.

        agree: the step agreement (None: one rank alone, its local progress is the agreed
        one); under several ranks every rank runs this same loop, one agreement per turn, so
        they apply the same ops in the same turn. Pauses briefly while copies run; TimeoutError
        (naming `what`) when ops are still pending after timeout_s."""
        deadline = time.monotonic() + timeout_s
        applied: list[TransferOp] = []
        while len(self.queues):
            progress = self.local_progress()
            done = self.apply(agree(progress) if agree is not None else progress)
            applied += done
            if not done:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{what}: {len(self.queues)} cache copies still pending after "
                        f"{timeout_s:g} s"
                    )
                time.sleep(0.0002)
        return applied

    # ---- op plumbing --------------------------------------------------------------------------
    def _submit(self, op: TransferOp) -> None:
        self.queues.add(op)
        self.mover.submit(op)

    def _store(self, node: Node) -> None:
        """Start the device -> host copy of a node without one (no-op when busy or no room)."""
        if node.host is not None or node.pins or node.device is None:
            return
        host_ids = self.tiers.alloc_host(len(node), like=node.device)  # same owner (cp)
        if host_ids is None:
            return
        node.pins += 1
        self._submit(TransferOp(STORE, list(node.device), host_ids, node=node))

    def _demote(self, node: Node, host_ids: list[int]) -> None:
        assert node.device is not None
        self._submit(TransferOp(STORE, list(node.device), host_ids, node=node, evict_after=True))

    def _load_done(self, op: TransferOp, ok: int) -> None:
        for node in _covering(op):
            node.pins -= 1
            self.tiers.touched(node)

    def _store_done(self, op: TransferOp, ok: int) -> None:
        nodes = _covering(op)
        if op.evict_after:
            self.tiers.freeing -= op.pages
        at = 0
        for node in nodes:
            node.pins -= 1
            if ok == op.pages:
                node.host = op.dst[at : at + len(node)]
                self.tiers.touched(node)
            at += len(node)
        if ok != op.pages:
            self.tiers.host.free(op.dst)  # type: ignore[union-attr]
            return
        for node in nodes:
            # a demotion was an eviction: a pin taken since keeps the host copy it just got
            if op.evict_after and not node.busy and not node.has_device_child():
                self.tiers.drop_device(node)
            self._backup(node)

    def _backup(self, node: Node) -> None:
        if self.has_storage and not node.in_storage and node.host is not None:
            node.pins += 1
            self._submit(
                TransferOp(
                    BACKUP,
                    list(node.host),
                    [],
                    keys=list(node.keys),
                    node=node,
                )
            )

    def _backup_done(self, op: TransferOp, ok: int) -> None:
        for node in _covering(op):
            node.pins -= 1
            node.in_storage = node.in_storage or ok == op.pages
            self.tiers.touched(node)

    def _prefetch_done(self, op: TransferOp, ok: int) -> None:
        parent = op.node
        assert parent is not None
        parent.pins -= 1
        self.counters.prefetch["complete" if ok == op.pages else "partial" if ok else "empty"] += 1
        spare = list(op.dst[ok:])
        if ok:
            tokens = op.tokens
            if tokens is not None:
                tokens = tokens[: ok * (len(tokens) // len(op.keys))]
            walked = self.tree.insert_host(
                parent, op.keys[:ok], op.dst[:ok], spare, tokens, op.seed, op.width
            )
            for node, fresh in walked:
                if fresh:
                    self.tiers.touched(node)
        if spare:
            self.tiers.host.free(spare)  # type: ignore[union-attr]
        self.tiers.touched(parent)

    # ---- reset --------------------------------------------------------------------------------
    def busy_pages(self) -> int:
        """Device pages a reset cannot drop now: owned by requests, or in locked/pinned nodes."""
        locked = sum(len(n.device) for n in self.tree.nodes() if n.device is not None and n.busy)
        return len(self.owned) + locked

    def reset_prefix(self, drop_host: bool = False) -> bool:
        """Forget every device page (vLLM's prefix-cache reset); drop_host: every host page too.

        storage is never touched. False (nothing changed) while a page is in use or a copy is in
        flight: the caller releases waiting leases, preempts running requests and drains
        (agreed) first. Each reset bumps `resets`, so KV events announce AllBlocksCleared.
        """
        if self.busy_pages() or len(self.queues):
            return False
        self.pins.clear()  # a reset forgets what clients asked to keep
        self.tiers.clear_device(drop_host)
        self.resets += 1
        return True

    # ---- integrity ----------------------------------------------------------------------------
    def accounting(self) -> dict[str, dict[str, int]]:
        """free + cached + locked + in flight = capacity, per pool."""
        return integrity.accounting(self)

    def check_integrity(self) -> None:
        """Tree invariants, every page id accounted for exactly once in each pool, and every
        pin counted on its path and within the budget."""
        integrity.check(self)
        self.pins.check_integrity()

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters.as_dict(),
            "accounting": self.accounting(),
            "pending_ops": len(self.queues),
        }


def _noop(op: TransferOp, ok: int) -> None:
    """A probe changes no tree state: its answer is op.agreed."""


def _covering(op: TransferOp) -> list[Node]:
    """The nodes that now hold the op's pages (its node may have been split since), in order."""
    nodes, pages, node = [], 0, op.node
    while pages < op.pages:
        assert node is not None and node.parent is not None, "op node left the tree"
        nodes.append(node)
        pages += len(node)
        node = node.parent
    assert pages == op.pages, "op pages do not align with node edges"
    return nodes[::-1]

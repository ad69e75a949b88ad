"""The fleet router's own index of every replica's pages, fed by their KV event streams.

Per replica and medium ("GPU" device, "CPU" host memory, "DISK" storage) the set of pages it
holds, each keyed by (cache_salt, block hash): two tenants never share a match, even were their
block hashes to meet (they cannot among kvstrata replicas, whose keys chain the salt in; a
consumer of other publishers' events gets the same guarantee). A BlockStored block without a salt
of its own takes its parent's (vLLM salts only a chain's first block); a BlockRemoved names hashes
only, resolved through the salt each hash was stored under.

Pages in a store several replicas share (the same `storage` in their /v1/kv/events/info) count
for every one of them. Written by the subscriber threads, read by the request path: one lock.

A replica's entries are whole unless its subscriber owes a replay (one failed and is being
retried, kvstrata/router/subscriber.py): they then hold a prefix of its event history, which may
lack pages it holds and list pages it has since dropped. Until a replay completes its holdings
are unknown, and `match` counts them as none (the rule then places by session and load alone),
its pages in a shared store included (they count for no replica sharing it meanwhile).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.cache.event_wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

DEVICE, HOST, STORAGE = "GPU", "CPU", "DISK"
MEDIA = (DEVICE, HOST, STORAGE)

PageId = tuple[str, int]  # (cache_salt, block hash)


@dataclass(frozen=True)
class Match:
    """Leading prompt pages one replica holds: on device, on device-or-host, anywhere it reads."""

    device: int
    host: int
    storage: int


@dataclass
class _Replica:
    held: dict[str, set[PageId]] = field(default_factory=lambda: {m: set() for m in MEDIA})
    salt_of: dict[int, str] = field(
        default_factory=dict
    )  # block hash -> the salt it was stored under
    storage: str = ""  # the shared store's id ("" : none, or not shared)
    whole: bool = True  # False while the replica's subscriber owes a replay


class FleetIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}

    # ---- writers ---------------------------------------------------------------------------------
    def add(self, replica: str, storage: str) -> None:
        """Start (or restart) a replica's entries empty; `storage` names the store it reads."""
        with self._lock:
            self._replicas[replica] = _Replica(storage=storage)

    def drop(self, replica: str) -> None:
        """A replica left the routing set: its entries go with it."""
        with self._lock:
            self._replicas.pop(replica, None)

    def apply(self, replica: str, batch: EventBatch) -> None:
        """One event batch of `replica`'s stream (ignored once the replica was dropped)."""
        with self._lock:
            rep = self._replicas.get(replica)
            if rep is None:
                return
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    _store(rep, ev)
                elif isinstance(ev, BlockRemoved):
                    _remove(rep, ev)
                elif isinstance(ev, AllBlocksCleared):
                    rep.held = {m: set() for m in MEDIA}
                    rep.salt_of.clear()

    def set_whole(self, replica: str, whole: bool) -> None:
        """Whether `replica`'s entries are its whole history (False: a replay is owed)."""
        with self._lock:
            rep = self._replicas.get(replica)
            if rep is not None:
                rep.whole = whole

    # ---- readers ---------------------------------------------------------------------------------
    def whole(self, replica: str) -> bool:
        with self._lock:
            rep = self._replicas.get(replica)
            return rep is not None and rep.whole

    def match(self, replica: str, salt: str, hashes: Sequence[int]) -> Match:
        """How many leading `hashes` (a prompt's block hashes under `salt`) `replica` holds."""
        with self._lock:
            rep = self._replicas.get(replica)
            if rep is None or not rep.whole:
                return Match(0, 0, 0)  # unknown holdings count as none
            shared = [
                r.held[STORAGE]
                for r in self._replicas.values()
                if r is rep or (rep.storage and r.storage == rep.storage and r.whole)
            ]
            device = host = storage = 0
            for h in hashes:
                page = (salt, h)
                on_device = page in rep.held[DEVICE]
                in_host = on_device or page in rep.held[HOST]
                if not in_host and not any(page in s for s in shared):
                    break
                host += in_host and host == storage  # every page before it was in host too
                device += on_device and device == storage
                storage += 1
            return Match(device, host, storage)

    def blocks(self, replica: str) -> dict[str, set[int]]:
        """The block hashes `replica` holds per medium (what its /debug/blocks lists)."""
        with self._lock:
            rep = self._replicas.get(replica) or _Replica()
            return {m: {h for _, h in rep.held[m]} for m in MEDIA}

    def pages(self) -> dict[str, int]:
        """Pages indexed per medium, over every replica."""
        with self._lock:
            return {m: sum(len(r.held[m]) for r in self._replicas.values()) for m in MEDIA}

    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._replicas)


def _store(rep: _Replica, ev: BlockStored) -> None:
    medium = rep.held.setdefault(ev.medium, set())
    inherited = rep.salt_of.get(ev.parent_block_hash, "") if ev.parent_block_hash else ""
    for h, own in zip(ev.block_hashes, ev.salts, strict=True):
        salt = own or inherited
        inherited = salt
        rep.salt_of[h] = salt
        medium.add((salt, h))


def _remove(rep: _Replica, ev: BlockRemoved) -> None:
    medium = rep.held.setdefault(ev.medium, set())
    for h in ev.block_hashes:
        medium.discard((rep.salt_of.get(h, ""), h))
    for h in ev.block_hashes:  # a hash no medium holds any more forgets its salt
        page = (rep.salt_of.get(h, ""), h)
        if not any(page in s for s in rep.held.values()):
            rep.salt_of.pop(h, None)

"""Asynchronous page moves as counted events.

The manager submits a TransferOp to a PageMover and keeps it in a queue per kind, in submission
order. Each step the local outcome of the first `k` pending ops of every kind is read
(`local_progress`), agreed across ranks (minimum per slot: an op counts only when done
everywhere, with the fewest pages any rank got), and exactly the agreed ops are applied, in
queue order (`take_agreed`). Late ops wait.

Copies between device and host, and backups, finish in submission order and are applied so: a
slot after an unfinished one counts as unfinished. Storage reads (probes, prefetches) are not:
several storage workers read different requests' pages at once, so a short read queued behind a
long one finishes first, and it is applied as soon as every rank has it (`OUT_OF_ORDER`), rather
than waiting out the long one. Every rank's queues hold the same ops in the same order (the
same submissions), so slot i names the same op everywhere and the applied ops are the same.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstrata.cache.radix import Node

LOAD, STORE, BACKUP, PROBE, PREFETCH = "load", "store", "backup", "probe", "prefetch"
KINDS: tuple[str, ...] = (LOAD, STORE, BACKUP, PROBE, PREFETCH)
"""load: host->device, store: device->host, backup: host->storage, probe: how many leading keys
storage has, prefetch: storage->host."""
OUT_OF_ORDER = frozenset((PROBE, PREFETCH))
"""Kinds whose finished ops apply without waiting for unfinished ones queued before them:
storage reads, which several workers run at once. Applying them changes no state another
pending op of the kind reads (a probe changes nothing; a prefetch hangs its landed pages under
its own parent, which it holds, and a page another op landed first is freed as a duplicate)."""
NOT_DONE = -1


@dataclass(eq=False)
class TransferOp:
    """One batched page move; src/dst are page ids (or empty for the storage side)."""

    kind: str
    src: list[int]
    dst: list[int]
    keys: list[int] = field(default_factory=list)
    """Page keys of the moved pages (storage side of backup/prefetch; informative otherwise)."""
    tokens: bytes | None = None
    """prefetch only: the pages' token bytes, which the pages take into the tree."""
    seed: int = 0
    """prefetch only: the namespace seed of `tokens` (for pages hung under the root)."""
    width: int = 4
    """prefetch only: bytes per token id in `tokens` (2 or 4)."""
    node: Node | None = None
    """The tree node the op works for: its last covered node (load/store/backup) or parent (prefetch)."""
    handle: Any = None
    """Mover's handle (per-layer waits for loads)."""
    cancelled: bool = False
    evict_after: bool = False
    """store only: drop the device copy once the host copy landed (demotion on eviction)."""
    agreed: int | None = None
    """Pages moved OK on every rank, set when the op is applied."""
    started_s: float = 0.0
    """Agreed scheduler time at submission (prefetch budgets)."""
    written_bytes: int | None = None
    """backup only: bytes this rank's mover actually wrote (pages found stored already and kept
    count none); None: every page moved counts whole."""

    @property
    def pages(self) -> int:
        return max(len(self.src), len(self.dst), len(self.keys))


class PageMover(Protocol):
    """Moves page bytes between tiers; implemented by memory.transfer or a timing-only model."""

    def submit(self, op: TransferOp) -> None:
        """Start `op` asynchronously (set op.handle where the caller needs to wait on it)."""

    def poll(self, op: TransferOp) -> int | None:
        """Pages moved OK (a leading count) once `op` finished here, else None."""

    def wait_answered(self, op: TransferOp, timeout_s: float) -> None:
        """Block up to timeout_s until this rank's result for `op` is in, without counting as a
        poll (a mover whose ops finish as they are polled, or in steps, returns at once)."""

    def cancel(self, op: TransferOp) -> None:
        """Stop early (prefetch): pages already moved still count."""

    def release(self, op: TransferOp) -> None:
        """`op` was applied everywhere: drop what the mover kept of it."""


class OpQueues:
    """Pending ops of every kind in submission order."""

    def __init__(self, per_step: int) -> None:
        self.per_step = per_step
        self.pending: dict[str, deque[TransferOp]] = {k: deque() for k in KINDS}

    def add(self, op: TransferOp) -> None:
        self.pending[op.kind].append(op)

    def local_progress(self, mover: PageMover) -> list[int]:
        """[kinds x per_step] local results of the leading pending ops; NOT_DONE where unfinished.

        Outside OUT_OF_ORDER a slot after an unfinished one is NOT_DONE too, so agreement keeps
        submission order there.
        """
        vec: list[int] = []
        for kind in KINDS:
            queue, blocked = self.pending[kind], False
            for i in range(self.per_step):
                res = None if blocked or i >= len(queue) else mover.poll(queue[i])
                blocked = res is None and kind not in OUT_OF_ORDER
                vec.append(NOT_DONE if res is None else res)
        return vec

    def take_agreed(self, agreed: list[int]) -> list[tuple[TransferOp, int]]:
        """Take the ops the agreed vector says are done everywhere out of their queues, with
        their agreed page counts: each kind's in queue order, the kinds in KINDS order."""
        assert len(agreed) == len(KINDS) * self.per_step, "progress vector of the wrong length"
        done: list[tuple[TransferOp, int]] = []
        for k, kind in enumerate(KINDS):
            queue = self.pending[kind]
            slots = agreed[k * self.per_step : (k + 1) * self.per_step][: len(queue)]
            taken = [i for i, res in enumerate(slots) if res != NOT_DONE]
            done += [(queue[i], slots[i]) for i in taken]
            for i in reversed(taken):
                del queue[i]
        return done

    def inflight_ids(self, kind: str, side: str) -> list[int]:
        return [i for op in self.pending[kind] for i in getattr(op, side)]

    def __len__(self) -> int:
        return sum(len(q) for q in self.pending.values())

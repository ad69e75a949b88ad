"""Asynchronous page moves as counted events.

The manager submits a TransferOp to a PageMover and keeps it in a FIFO queue per kind. Each step
the local outcome of the first `k` pending ops of every kind is read (`local_progress`), agreed
across ranks (minimum per slot: an op counts only when done everywhere, with the fewest pages any
rank got), and exactly the agreed ops are applied, in order (`take_agreed`). Late ops wait.
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

        A slot after an unfinished one is NOT_DONE too, so agreement keeps submission order.
        """
        vec: list[int] = []
        for kind in KINDS:
            queue, blocked = self.pending[kind], False
            for i in range(self.per_step):
                res = None if blocked or i >= len(queue) else mover.poll(queue[i])
                blocked = res is None
                vec.append(NOT_DONE if res is None else res)
        return vec

    def take_agreed(self, agreed: list[int]) -> list[tuple[TransferOp, int]]:
        """Pop the ops the agreed vector says are done everywhere, with their agreed page counts."""
        assert len(agreed) == len(KINDS) * self.per_step, "progress vector of the wrong length"
        done: list[tuple[TransferOp, int]] = []
        for k, kind in enumerate(KINDS):
            for res in agreed[k * self.per_step : (k + 1) * self.per_step]:
                if res == NOT_DONE or not self.pending[kind]:
                    break
                done.append((self.pending[kind].popleft(), res))
        return done

    def inflight_ids(self, kind: str, side: str) -> list[int]:
        return [i for op in self.pending[kind] for i in getattr(op, side)]

    def __len__(self) -> int:
        return sum(len(q) for q in self.pending.values())

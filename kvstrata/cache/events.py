"""Which pages each medium holds, as changes between two looks at the tree (for KV events).

The tree is the cache's agreed state, so the changes are agreed decisions: every rank would
report the same ones, and rank 0 publishes them. A page is on "GPU" while a node holds device
pages for it (a host -> device load in flight included: the decision is made), on "CPU" while it
holds host pages, on "DISK" once a backup or prefetch agreed it is in storage. `diff` walks the
whole tree; the server calls it once per step, only when events are enabled.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.cache.radix import Node, RadixTree

MEDIA = ("GPU", "CPU", "DISK")
MASK64 = (1 << 64) - 1


def block_hash(key: int) -> int:
    """A page key as KV events carry it: its low 64 bits (msgpack integers are 64-bit)."""
    return key & MASK64


@dataclass(frozen=True)
class BlockChange:
    """Consecutive pages of one chain entering (stored) or leaving (removed) one medium."""

    stored: bool
    medium: str
    keys: list[int]
    parent: int | None  # key of the page before keys[0] (stored only; None at the root)


def _media(node: Node) -> tuple[str, ...]:
    out = []
    if node.device is not None:
        out.append("GPU")
    if node.host is not None:
        out.append("CPU")
    if node.in_storage:
        out.append("DISK")
    return tuple(out)


def snapshot(tree: RadixTree) -> dict[str, set[int]]:
    """The keys each medium holds now."""
    held: dict[str, set[int]] = {m: set() for m in MEDIA}
    for node in tree.nodes():
        for medium in _media(node):
            held[medium].update(node.keys)
    return held


class BlockTracker:
    """Remembers what it last reported; `diff` returns what changed since."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {m: set() for m in MEDIA}

    def diff(self, tree: RadixTree) -> list[BlockChange]:
        changes: list[BlockChange] = []
        now: dict[str, set[int]] = {m: set() for m in MEDIA}
        for node in tree.nodes():
            media = _media(node)
            if not media:
                continue
            parent = node.parent.keys[-1] if node.parent is not None and node.parent.keys else None
            for medium in media:
                now[medium].update(node.keys)
                changes += _new_runs(node.keys, parent, medium, self.held[medium])
        for medium in MEDIA:
            gone = self.held[medium] - now[medium]
            if gone:
                changes.append(BlockChange(False, medium, sorted(gone), None))
        self.held = now
        return changes


def _new_runs(keys: list[int], parent: int | None, medium: str, old: set[int]) -> list[BlockChange]:
    """Runs of keys not reported on `medium` before, each with the key in front of it."""
    runs: list[BlockChange] = []
    start: int | None = None
    for i, key in enumerate([*keys, None]):
        new = key is not None and key not in old
        if new and start is None:
            start = i
        elif not new and start is not None:
            before = keys[start - 1] if start else parent
            runs.append(BlockChange(True, medium, keys[start:i], before))
            start = None
    return runs

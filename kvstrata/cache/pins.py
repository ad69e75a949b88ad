"""Client pins: a prefix a client asked to keep (`cache_control`, `kv_pin_s`), until a deadline.

A pin holds the path from the root down to one node (its prefix, whole pages): every node on it
has `keep > 0`, which the tiers read (tiers.py): a kept page never leaves the host tier, and
leaves the device (having a host copy) in LRU order with the unpinned pages once the pinned
ones hold more than their device share (`pin_device_share`), else after them. Pins are
tensor-free and read agreed state only: a pin enters with its request (the step input every rank
sees) and its deadline is judged on the agreed step clock (`tick(now_s)`), never a rank's own
wall time, so every rank pins and expires the same pages at the same step.

The budget rule lives here, once: pinned pages (distinct pages under any pin) stay within
`budget` x the holding pool (host when there is one, else device). A new pin that would pass
it drops the oldest pins (least recently made or renewed) first; a pin larger than the whole
budget is refused. Pins never take pages from a running request: they only keep cached pages
from eviction, and the budget leaves the rest of each pool to unpinned pages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvstrata.cache.counters import PinCounts
from kvstrata.cache.radix import Node, RadixTree

TTL_CHOICES_S = {"5m": 300.0, "1h": 3600.0}
"""The TTLs a `cache_control` block may name (Anthropic's prompt caching)."""
DEFAULT_TTL_S = TTL_CHOICES_S["5m"]
MAX_TTL_S = TTL_CHOICES_S["1h"]


@dataclass(frozen=True)
class PinSpec:
    """What a request asks to keep: its first `tokens` prompt tokens (whole pages of them), for
    `ttl_s` seconds of the step clock after each use."""

    tokens: int
    ttl_s: float = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"a pin covers >= 0 tokens, got {self.tokens}")
        if not 0 < self.ttl_s <= MAX_TTL_S:
            raise ValueError(f"a pin's ttl must be in (0, {MAX_TTL_S:g}] s, got {self.ttl_s}")


@dataclass
class Pin:
    """One held prefix: the path from the root to `node`."""

    node: Node
    pages: int
    ttl_s: float
    deadline_s: float
    seq: int  # order of making or renewal: the lowest loses first


class PinBook:
    """Every live pin of one cache, its budget, and its expiry on the agreed step clock."""

    def __init__(
        self,
        tree: RadixTree,
        limit_pages: int,
        device_share: int,
        touched: Callable[[Node], None],
        counts: PinCounts | None = None,
    ) -> None:
        """limit_pages: the budget (distinct pinned pages); device_share: the device pages
        pinned ones may hold ahead of unpinned ones."""
        self.tree, self.limit, self.device_share = tree, limit_pages, device_share
        self.touched = touched  # an unpinned node may have become an eviction candidate
        self.pins: dict[Node, Pin] = {}  # by the node that ends the pinned prefix
        self.pinned = 0  # distinct pages under some pin
        self.now_s = 0.0  # the agreed step clock, as of the last tick
        self.counts = counts if counts is not None else PinCounts()
        self._seq = 0

    # ---- decisions (agreed inputs only) -------------------------------------------------------
    def tick(self, now_s: float) -> list[Pin]:
        """The step clock moved to now_s: pins past their deadline let go (returned)."""
        self.now_s = max(self.now_s, now_s)
        gone = [p for p in self.pins.values() if p.deadline_s <= self.now_s]
        for pin in gone:
            self._drop(pin)
        self.counts.expired += len(gone)
        self.counts.pinned_pages = self.pages_by_tier()
        return gone

    def pin(self, node: Node, ttl_s: float) -> int:
        """Keep the prefix that ends at `node` for ttl_s; the pages pinned (0: refused)."""
        pages = self.tree.depth(node)
        old = self.pins.get(node)
        if old is not None:
            self._renew(old, ttl_s)
            return pages
        if pages > self.limit:
            self.counts.refused_for_budget += 1
            return 0
        while self.pinned + self._unkept(node) > self.limit:
            oldest = min(self.pins.values(), key=lambda p: p.seq)
            self._drop(oldest)
            self.counts.dropped_for_budget += 1
        self.pinned += self._unkept(node)
        for n in _path(self.tree, node):
            n.keep += 1
        self._seq += 1
        self.pins[node] = Pin(node, pages, ttl_s, self.now_s + ttl_s, self._seq)
        self.counts.made += 1
        return pages

    def pin_at(self, end: Node, pages: int, ttl_s: float) -> int:
        """`pin` of the node ending exactly `pages` pages down the path to `end` (the upper
        part of a node split there, if the prefix ends inside one)."""
        depth, node = self.tree.depth(end), end
        assert 0 < pages <= depth, f"a pin of {pages} pages on a path of {depth}"
        while depth - len(node) >= pages:
            depth -= len(node)
            node = node.parent  # type: ignore[assignment]
        if pages < depth:
            node = self.tree.split(node, len(node) - (depth - pages))
            self.touched(node)
        return self.pin(node, ttl_s)

    def renew_path(self, node: Node) -> None:
        """A request used the prefix ending at `node`: every pin on it starts its TTL again."""
        for n in _path(self.tree, node):
            pin = self.pins.get(n)
            if pin is not None:
                self._renew(pin, pin.ttl_s)

    def lose(self, node: Node) -> None:
        """`node` leaves every tier (a caller dropped its only copy): the pins over it go."""
        for pin in [p for p in self.pins.values() if _under(self.tree, p.node, node)]:
            self._drop(pin)
            self.counts.lost += 1

    def clear(self) -> None:
        """Drop every pin (a prefix-cache reset forgets them)."""
        for pin in list(self.pins.values()):
            self._drop(pin)

    # ---- inspection ---------------------------------------------------------------------------
    def kept_nodes(self) -> Iterator[Node]:
        """Every node under some pin, once each."""
        seen: set[int] = set()
        for pin in self.pins.values():
            for n in _path(self.tree, pin.node):
                if id(n) in seen:
                    break  # the rest of the path was walked from another pin
                seen.add(id(n))
                yield n

    def device_over(self) -> bool:
        """Pinned pages hold more than their share of the device (it may take theirs in LRU
        order with the unpinned ones)."""
        return bool(self.pins) and self.pages_by_tier()["device"] > self.device_share

    def pages_by_tier(self) -> dict[str, int]:
        out = {"device": 0, "host": 0}
        for n in self.kept_nodes():
            out["device"] += len(n) if n.device is not None else 0
            out["host"] += len(n) if n.host is not None else 0
        return out

    def check_integrity(self) -> None:
        """Every node's keep is the number of pins over it; pinned pages add up and fit."""
        want: dict[int, int] = {}
        for pin in self.pins.values():
            assert pin.node.parent is not None, "a pinned node left the tree"
            assert self.tree.depth(pin.node) == pin.pages, "a pin's depth changed"
            for n in _path(self.tree, pin.node):
                want[id(n)] = want.get(id(n), 0) + 1
        pinned = 0
        for n in self.tree.nodes():
            assert n.keep == want.get(id(n), 0), f"keep {n.keep} != {want.get(id(n), 0)} pins"
            pinned += len(n) if n.keep else 0
        assert pinned == self.pinned, f"{pinned} pinned pages, the book says {self.pinned}"
        assert self.pinned <= self.limit, f"{self.pinned} pinned pages over the budget {self.limit}"

    # ---- plumbing -----------------------------------------------------------------------------
    def _renew(self, pin: Pin, ttl_s: float) -> None:
        self._seq += 1
        pin.seq, pin.ttl_s = self._seq, max(pin.ttl_s, ttl_s)
        pin.deadline_s = max(pin.deadline_s, self.now_s + pin.ttl_s)
        self.counts.renewed += 1

    def _unkept(self, node: Node) -> int:
        """Pages on the path to `node` that no pin covers yet."""
        return sum(len(n) for n in _path(self.tree, node) if n.keep == 0)

    def _drop(self, pin: Pin) -> None:
        del self.pins[pin.node]
        for n in _path(self.tree, pin.node):
            n.keep -= 1
            if n.keep == 0:
                self.pinned -= len(n)
                self.touched(n)


def _under(tree: RadixTree, node: Node, top: Node) -> bool:
    """`node` is `top` or below it."""
    return any(n is top for n in _path(tree, node))


def _path(tree: RadixTree, node: Node) -> Iterator[Node]:
    """`node` and its ancestors up to (not including) the root."""
    while node is not tree.root:
        yield node
        node = node.parent  # type: ignore[assignment]

"""STAND-IN, deleted when the router's rule (kvstrata/router/rule.py) is merged: the routing rule's
interface as the fleet simulator calls it, with a minimal body of the same shape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

LOAD_WEIGHT = 0.25


@dataclass(frozen=True)
class Candidate:
    name: str
    device: int
    host: int  # cumulative: >= device
    storage: int  # cumulative: >= host
    load: int

    def saved(self) -> float:
        return self.device + 0.8 * (self.host - self.device) + 0.5 * (self.storage - self.host)


def _place(session: str, name: str) -> int:
    return xxhash.xxh64_intdigest(f"{session}\x00{name}".encode())


def choose(cands: Sequence[Candidate], pages: int, session: str | None, load_weight: float) -> str:
    tie = session or ""
    if all(c.saved() == 0 for c in cands):
        if session is not None:
            return max((c.name for c in cands), key=lambda n: _place(session, n))
        return min(cands, key=lambda c: (c.load, -_place(tie, c.name))).name
    whole = max(pages, 1)
    return min(
        cands,
        key=lambda c: (
            1 - c.saved() / whole + load_weight * c.load,
            -c.saved(),
            -_place(tie, c.name),
        ),
    ).name

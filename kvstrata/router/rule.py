"""The fleet's routing rule: which replica takes a request (one pure function, tested exactly).

Inputs, per replica: how many leading pages of the prompt it holds on device, on device-or-host,
and anywhere it can read (device, host, or a store it shares), each a prefix length in pages
(so device <= host <= storage); its load (running + waiting requests, the router's own in-flight
ones included). Per request: its page count and its session identity (or None).

Prefill saved on a replica, in pages, weighs each page by where it would come from:
    saved = DEVICE_WEIGHT * device + HOST_WEIGHT * (host - device) + STORAGE_WEIGHT * (storage - host)
A device page costs nothing; a host page costs a copy to the device (cheap, overlapped with
compute); a storage page costs a read from the store and that copy. The cost of sending the
request to a replica is the share of the prompt it must still compute plus the queue it joins:
    cost = 1 - saved / pages + load_weight * load
and the cheapest replica wins. The load term keeps a hot prefix from piling every session on one
replica: with load_weight 0.25 a replica holding the whole prompt is left once it has 4 more
requests than one holding none of it.

With no prefix held anywhere (every saved = 0) a request with a session identity goes where the
identity hashes (rendezvous hashing over the replicas: a replica that leaves moves only the
sessions that hashed to it), so a session's turns meet its pages; without one, the least loaded
replica. Ties go by the same hash (deterministic, never Python's hash()); a request without a
session identity is hashed by its `spread` key instead (the caller's digest of its first page), so
anonymous prompts on an idle fleet spread over the replicas rather than all landing on the one
that an empty identity hashes to, and prompts that start alike meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

DEVICE_WEIGHT = 1.0
HOST_WEIGHT = 0.8
STORAGE_WEIGHT = 0.5


@dataclass(frozen=True)
class Candidate:
    """One live replica as the rule sees it."""

    name: str  # its base URL (the hash input of session placement)
    device: int  # leading prompt pages on its device
    host: int  # leading prompt pages on its device or in its host memory (>= device)
    storage: int  # leading prompt pages it can read from anywhere (>= host)
    load: int  # running + waiting requests

    def saved(self) -> float:
        """Prefill pages saved, each weighed by its tier."""
        return (
            DEVICE_WEIGHT * self.device
            + HOST_WEIGHT * (self.host - self.device)
            + STORAGE_WEIGHT * (self.storage - self.host)
        )


def placement(session: str, name: str) -> int:
    """Rendezvous weight of `session` on replica `name` (the highest wins)."""
    return xxhash.xxh64_intdigest(f"{session}\x00{name}".encode())


def session_replica(session: str, names: Sequence[str]) -> str:
    """Where a session lives among `names` (consistent: removing a name moves only its own)."""
    return max(names, key=lambda n: placement(session, n))


def rank(
    cands: Sequence[Candidate],
    pages: int,
    session: str | None,
    load_weight: float,
    spread: str = "",
) -> list[str]:
    """Every candidate's name, best first (the first is the choice; the rest are the order to
    retry in when a replica refuses the connection). `spread`: the tie-break identity of a
    request without a session."""
    if not cands:
        raise ValueError("no replica to route to")
    tie = session or spread
    if all(c.saved() == 0 for c in cands):
        if session is not None:
            home = session_replica(session, [c.name for c in cands])
            rest = sorted((c for c in cands if c.name != home), key=lambda c: _idle(c, tie))
            return [home, *(c.name for c in rest)]
        return [c.name for c in sorted(cands, key=lambda c: _idle(c, tie))]
    whole = max(pages, 1)

    def cost(c: Candidate) -> tuple[float, float, int]:
        return (1.0 - c.saved() / whole + load_weight * c.load, -c.saved(), -placement(tie, c.name))

    return [c.name for c in sorted(cands, key=cost)]


def _idle(c: Candidate, tie: str) -> tuple[int, int]:
    return c.load, -placement(tie, c.name)


def choose(
    cands: Sequence[Candidate],
    pages: int,
    session: str | None,
    load_weight: float,
    spread: str = "",
) -> str:
    """The replica that takes the request."""
    return rank(cands, pages, session, load_weight, spread)[0]


def spread_key(first_page: Sequence[int]) -> str:
    """The tie-break identity of a request without a session: a digest of its first page's
    token ids (or block ids)."""
    return xxhash.xxh64_hexdigest(",".join(map(str, first_page)).encode())

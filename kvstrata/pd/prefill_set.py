"""Which prefill workers a decode worker hands off to: its configured `--pd-prefill` set only.

A request may name one of them (`pd_prefill`: the router does, to spread load), spelled as the
configured entry itself or as the transfer endpoint(s) that entry's GET /v1/pd/info gives (what
the router reads from /v1/pd/info and sends). Anything else is refused before the request enters
the engine: a client that reaches decode directly cannot make it exchange KV with a peer of its
own (which would answer with made-up pages that decode then caches for every later client), nor
make decode fetch a URL of its choice (server-side request forgery). Only configured workers'
/v1/pd/info is ever fetched.
"""

from __future__ import annotations

import threading
from typing import Protocol

import httpx2 as httpx

SCHEMES = ("http://", "https://", "tcp://")


class NotAllowed(ValueError):
    """A request named a prefill worker outside this decode worker's configured set."""

    status = 403  # the HTTP answer: the name is well formed, but not allowed


class Unverifiable(ValueError):
    """A request named a transfer endpoint no reachable configured worker listens on, and some
    configured worker could not be asked (it may be that one, restarted or down)."""

    status = 502  # the HTTP answer: an upstream this check needs is unreachable


class EndpointSource(Protocol):
    """Resolves a configured entry to its transfer endpoints (kvstrata/pd/decode.py: Resolver)."""

    def endpoints_of(self, target: str) -> list[str]: ...

    def forget(self, target: str) -> None: ...


class PrefillSet:
    """The configured prefill entries, and the check of a request's `pd_prefill` against them.

    trust_requests (tests, a single trusted client): take a request's value as it is."""

    def __init__(self, entries: list[str], source: EndpointSource, trust_requests: bool) -> None:
        self.entries = [e.rstrip("/") for e in entries]
        self.source, self.trust_requests = source, trust_requests

    def pick(self, wanted: str) -> str:
        """The configured entry `wanted` names (what the hand-off then resolves and dials).
        Blocking (may read configured workers' /v1/pd/info): call off the event loop."""
        if not wanted.startswith(SCHEMES):
            raise ValueError(f"pd_prefill {wanted!r} is not an http(s):// or tcp:// address")
        if self.trust_requests:
            return wanted
        if wanted.rstrip("/") in self.entries:
            return self._known(wanted.rstrip("/"))
        down: list[str] = []
        if wanted.startswith("tcp://"):
            asked = wanted.split(",")
            # cached endpoints first; then once more after re-reading (a restarted prefill
            # listens on a new port, which the router may already know)
            for fresh in (False, True):
                entry = self._entry_listening_on(asked, fresh, down)
                if entry is not None:
                    return entry
        if down:
            raise Unverifiable(
                f"pd_prefill {wanted!r} cannot be checked: prefill worker(s) "
                f"{', '.join(dict.fromkeys(down))} unreachable"
            )
        listed = ", ".join(self.entries) or "none"
        raise NotAllowed(
            f"pd_prefill {wanted!r} is not one of this decode worker's prefill workers "
            f"(--pd-prefill: {listed})"
        )

    def _known(self, entry: str) -> str:
        """`entry`, its endpoints read now if this side has not read them yet: a later request
        that names them (the router sends endpoints) is then checked without asking a worker
        that may have stopped answering since. A worker down now is the hand-off's to report."""
        if not entry.startswith("tcp://"):
            try:
                self.source.endpoints_of(entry)
            except (OSError, httpx.HTTPError, ValueError):
                pass
        return entry

    def _entry_listening_on(self, asked: list[str], fresh: bool, down: list[str]) -> str | None:
        """The configured entry whose endpoints are `asked`; entries that could not be read go
        to `down`."""
        for entry in self.entries:
            if entry.startswith("tcp://"):
                if entry.split(",") == asked:
                    return entry
                continue
            if fresh:
                self.source.forget(entry)
            try:
                if self.source.endpoints_of(entry) == asked:
                    return entry
            except (OSError, httpx.HTTPError, ValueError):
                down.append(entry)  # down now: it may be the one named (on a new port later)
        return None


class PrefillPicker:
    """The prefill worker of each new request on a decode worker (its HTTP side)."""

    def __init__(self, allowed: PrefillSet, urls: list[str]) -> None:
        """urls: the configured entries, in turn (as given)."""
        self.allowed, self.urls = allowed, urls
        self._next = 0
        self._lock = threading.Lock()

    def choose(self, wanted: str | None) -> str:
        """The configured one the router named (else NotAllowed), or the next in turn.
        Blocking (may read a configured worker's /v1/pd/info): call off the event loop."""
        if wanted:
            return self.allowed.pick(wanted)
        urls = self.urls
        if not urls:
            raise ValueError("this decode worker has no --pd-prefill: it has no prefill worker")
        with self._lock:
            self._next += 1
            return urls[(self._next - 1) % len(urls)]

"""The router's view of its workers: round-robin choice, the start-up role check, and the one
place that turns a client's request body into what a decode worker is sent.

Decode goes first (docs/PD.md): the router sends the whole OpenAI request to a decode worker and
names the prefill worker it chose; decode runs the handshake with that prefill worker itself.
Without `require_info` (ordinary `kvstrata serve` processes as upstreams) the body goes to the
decode worker unchanged and the prefill list is only health-checked.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx

from kvstrata.http.paths import PD_INFO_PATH
from kvstrata.router.config import RouterConfig

PD_FIELD = "pd_prefill"
"""Body field a decode worker reads: the prefill worker to use for this request (its tcp://
transfer endpoint from /v1/pd/info, or its HTTP base URL, which decode then resolves)."""


class RoundRobin:
    """Worker URLs taken in turn, skipping workers marked down (thread-safe: the launcher's tests
    pick from threads too). A mark lasts until its time or the worker's next good /health."""

    def __init__(self, role: str, urls: tuple[str, ...]) -> None:
        if not urls:
            raise ValueError(f"no {role} workers")
        self.role, self.urls = role, urls
        self._next = 0  # index of the worker whose turn is next
        self._down: dict[str, float] = {}  # url -> time.monotonic() until which it is skipped
        self._lock = threading.Lock()

    def pick(self) -> str:
        """The next worker not marked down; with every one down, the next in turn (the request
        then fails naming it, rather than waiting)."""
        return self.order()[0]

    def order(self) -> list[str]:
        """Every worker once, for one request's tries: from the next in turn, those not marked
        down first, then the ones marked down (they may have come back)."""
        n, now = len(self.urls), time.monotonic()
        with self._lock:
            turn = [(self._next + i) % n for i in range(n)]
            up = [i for i in turn if self._down.get(self.urls[i], 0.0) <= now]
            first = up[0] if up else turn[0]
            self._next = (first + 1) % n  # the next request starts after the one chosen now
            return [self.urls[i] for i in up + [i for i in turn if i not in up]]

    def mark_down(self, url: str, for_s: float) -> None:
        with self._lock:
            self._down[url] = time.monotonic() + for_s

    def mark_up(self, url: str) -> None:
        with self._lock:
            self._down.pop(url, None)

    def down(self) -> list[str]:
        """Workers skipped now."""
        with self._lock:
            now = time.monotonic()
            return [u for u in self.urls if self._down.get(u, 0.0) > now]


@dataclass
class Upstreams:
    """Both pools, and the /v1/pd/info answers read at start (empty without require_info)."""

    cfg: RouterConfig
    headers: dict[str, str] = field(default_factory=dict)  # sent to every worker (its API key)
    prefill: RoundRobin = field(init=False)
    decode: RoundRobin = field(init=False)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cfg.check_complete()
        # a fleet has no P/D workers (all() lists none): its pools stand unused over the replicas
        self.prefill = RoundRobin("prefill", self.cfg.prefill or self.cfg.replicas)
        self.decode = RoundRobin("decode", self.cfg.decode or self.cfg.replicas)

    def all(self) -> list[tuple[str, str]]:
        """(role, url) of every worker."""
        return [("prefill", u) for u in self.cfg.prefill] + [("decode", u) for u in self.cfg.decode]

    def pool(self, role: str) -> RoundRobin:
        return self.prefill if role == "prefill" else self.decode

    def decode_body(self, body: dict[str, Any], prefill_url: str) -> dict[str, Any]:
        """What the decode worker is sent for one client request (the client's own fields kept)."""
        if not self.cfg.require_info:
            return body
        return {**body, PD_FIELD: self.transfer_endpoints(prefill_url)}

    def take_info(self, role: str, url: str, status: int, body: Any) -> str | None:
        """A worker's /v1/pd/info answer, re-read after start: kept when it says its role (a
        restarted prefill has a new transfer endpoint); else why it cannot be used."""
        if status != 200:
            return f"{role} {url}: {PD_INFO_PATH} answered HTTP {status}"
        said = body.get("role") if isinstance(body, dict) else None
        if said != role:
            return f"{role} {url}: {PD_INFO_PATH} says role {said!r}"
        self.info[url] = dict(body)
        return None

    def transfer_endpoints(self, url: str) -> str:
        """What decode is told for prefill `url`: its transfer endpoints as last read (a worker
        on several ranks: every rank's, rank order; decode rank r talks to the r-th)."""
        info = self.info.get(url, {})
        endpoints = ",".join(info.get("transfer_endpoints") or [])
        return endpoints or info.get("transfer_endpoint") or url

    def check_roles(self) -> None:
        """GET /v1/pd/info of every worker (retried until start_timeout_s): each must say the
        role it was listed under. A ValueError names the worker and what it said."""
        if not self.cfg.require_info:
            return
        for role, url in self.all():
            info = fetch_info(url, self.cfg, self.headers)
            said = info.get("role")
            if said != role:
                raise ValueError(
                    f"worker {url} listed as --{role} says role {said!r} at {PD_INFO_PATH}"
                )
            self.info[url] = info


def fetch_info(url: str, cfg: RouterConfig, headers: dict[str, str]) -> dict[str, Any]:
    """The worker's /v1/pd/info JSON; bounded by start_timeout_s, each try by info_timeout_s.
    A 401 ends the wait at once: the router's worker key is missing or wrong."""
    deadline = time.monotonic() + cfg.start_timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}{PD_INFO_PATH}", timeout=cfg.info_timeout_s, headers=headers)
            if r.status_code == 200:
                return dict(r.json())
        except (httpx.HTTPError, ValueError) as exc:  # not up yet, or not JSON yet
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
            continue
        last = f"HTTP {r.status_code}: {r.text[:200]}"
        if r.status_code == 401:  # outside the try: a wrong key is not retried
            raise ValueError(
                f"worker {url} refused the router's API key at {PD_INFO_PATH} (HTTP 401): give "
                "--router-worker-api-key-file (or the router the workers' --api-key-file)"
            )
        if r.status_code == 404:  # an ordinary server: waiting will not change it
            break
        time.sleep(0.2)
    raise ValueError(
        f"worker {url}: no {PD_INFO_PATH} within {cfg.start_timeout_s} s ({last}); "
        "is it a `kvstrata serve --role prefill|decode`? (--no-router-require-info skips this)"
    )

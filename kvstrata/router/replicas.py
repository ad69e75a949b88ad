"""A fleet router's replicas: which are in the routing set, their load, their event subscribers.

Every health_interval_s the router GETs each replica's /health and /metrics (running + waiting
requests: its load) at once. A replica that fails leaves the routing set at that round: its
subscriber stops and its index entries go (its sessions then hash elsewhere). A replica that
answers again (or for the first time) is read anew: GET /v1/kv/events/info (its event sockets,
page-key namespace and shared store; it may have restarted with other ones), a fresh subscriber
replays its buffer into the index, and it rejoins. A replica whose info cannot be read (no KV
events) still serves, its pages unknown to the router. Each replica's round is guarded: a
failure is counted and the loop goes on.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx

from kvstrata.cache.keys import Namespace
from kvstrata.http.paths import KV_EVENTS_INFO_PATH
from kvstrata.router.config import RouterConfig
from kvstrata.router.index import FleetIndex
from kvstrata.router.metrics import FleetMetrics
from kvstrata.router.subscriber import EventSource, Subscriber, connectable
from kvstrata.zmq_curve import CurveKeys

_GAUGE = re.compile(r"^kvstrata:num_requests_(running|waiting)\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


@dataclass
class Replica:
    url: str
    up: bool = False
    namespace: Namespace | None = None  # None: its pages are not indexed
    storage: str = ""
    polled_load: int = 0  # running + waiting at the last poll
    in_flight: int = 0  # the router's own requests on it now
    subscriber: Subscriber | None = None
    info: dict[str, Any] = field(default_factory=dict)
    why: str = "not probed yet"  # while not up: what its last health round met

    @property
    def load(self) -> int:
        """Running + waiting as last polled, or the router's in-flight count if higher (a burst
        between two polls)."""
        return max(self.polled_load, self.in_flight)


def parse_load(metrics_text: str) -> int:
    """running + waiting from a replica's /metrics text."""
    return int(sum(float(v) for _, v in _GAUGE.findall(metrics_text)))


class ReplicaPool:
    def __init__(
        self,
        cfg: RouterConfig,
        index: FleetIndex,
        metrics: FleetMetrics,
        keys: CurveKeys | None,
    ) -> None:
        self.cfg, self.index, self.metrics, self.keys = cfg, index, metrics, keys
        self.replicas = {url: Replica(url) for url in cfg.replicas}
        self.on_join: list[Any] = []  # async callables(replica): e.g. register with an indexer

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.up]

    async def refresh(self, client: httpx.AsyncClient) -> None:
        """One health round over every replica at once."""
        await asyncio.gather(*(self._guarded(client, r) for r in self.replicas.values()))
        self.metrics.replicas_up.set(len(self.live()))
        for medium, n in self.index.pages().items():
            self.metrics.index_pages.labels(medium=medium).set(n)

    async def wait_any(self, client: httpx.AsyncClient) -> None:
        """At start: rounds until every replica answered, or start_timeout_s with at least one
        (ValueError naming each replica's last failure when none did)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.start_timeout_s
        while True:
            await self.refresh(client)
            if all(r.up for r in self.replicas.values()):
                return
            if loop.time() > deadline:
                if self.live():
                    return
                raise ValueError(
                    f"no replica joined within {self.cfg.start_timeout_s} s: "
                    + "; ".join(f"{r.url}: {r.why}" for r in self.replicas.values())
                )
            await asyncio.sleep(0.2)

    def close(self) -> None:
        for r in self.replicas.values():
            self.leave(r, "router stopping")

    # ---- internals --------------------------------------------------------------------------------
    async def _guarded(self, client: httpx.AsyncClient, rep: Replica) -> None:
        try:
            await self._round(client, rep)
        except Exception as exc:  # noqa: BLE001 - one replica's surprise never stops the loop
            kind = type(exc).__name__
            self.metrics.health_failures.labels(replica=rep.url, kind=kind).inc()
            self.leave(rep, f"{kind}: {exc}")

    async def _round(self, client: httpx.AsyncClient, rep: Replica) -> None:
        timeout = self.cfg.info_timeout_s
        try:
            health = await client.get(f"{rep.url}/health", timeout=timeout)
            why = "" if health.status_code == 200 else f"/health: HTTP {health.status_code}"
            text = "" if why else (await client.get(f"{rep.url}/metrics", timeout=timeout)).text
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why:
            self.leave(rep, why)
            return
        rep.polled_load = parse_load(text)
        self.metrics.load.labels(replica=rep.url).set(rep.polled_load)
        if not rep.up:
            await self._join(client, rep)

    async def _join(self, client: httpx.AsyncClient, rep: Replica) -> None:
        r = await client.get(f"{rep.url}{KV_EVENTS_INFO_PATH}", timeout=self.cfg.info_timeout_s)
        if r.status_code == 200:
            self._subscribe(rep, r.json())
        for hook in self.on_join:
            await hook(rep)
        rep.up = True

    def _subscribe(self, rep: Replica, info: dict[str, Any]) -> None:
        rep.info = info
        rep.namespace = Namespace(**info["namespace"])
        rep.storage = str(info.get("storage") or "")
        replay = info.get("replay_endpoint")
        server_key = info.get("curve_server_key")
        src = EventSource(
            rep.url,
            connectable(str(info["endpoint"]), rep.url),
            connectable(str(replay), rep.url) if replay else None,
            str(info.get("topic") or "").encode(),
            server_key.encode() if info.get("curve") and server_key else None,
            rep.storage,
        )
        self.index.add(rep.url, rep.storage)
        rep.subscriber = Subscriber(src, self.index, self.metrics, self.keys)
        rep.subscriber.start()

    def leave(self, rep: Replica, why: str) -> None:
        """Out of the routing set (`why`), its subscriber stopped and its index entries gone."""
        rep.why = why
        if rep.subscriber is not None:
            rep.subscriber.stop()
            rep.subscriber = None
        self.index.drop(rep.url)
        rep.up = False

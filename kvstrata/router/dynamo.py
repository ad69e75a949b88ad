"""Dynamo's standalone KV indexer (`python -m dynamo.indexer`, ai-dynamo-runtime) as the fleet's
index: the router registers each replica's event socket with it and asks it per request.

Its HTTP API (1.6.1): POST /register {instance_id, endpoint, model_name, block_size,
replay_endpoint} subscribes it to a replica's events; POST /unregister {instance_id, model_name};
POST /query {token_ids, model_name} answers per instance the tokens of the longest prefix it
holds on "gpu", on gpu-or-"cpu", and anywhere down to "disk" (each tier counting those above it,
as our Match does); GET /workers and /dump show its state. Pages in a store replicas share count
for each of them, as in the router's own index (the indexer knows only who wrote them). It hashes token ids itself and ignores extra_keys, so it cannot keep
tenants apart: the router asks it only for unsalted requests (salted ones keep to the router's
own index), and a tenant's pages whose tokens equal an unsalted prompt's may be credited to it (a
misprediction, never shared pages: the replicas' keys chain the salt in). It speaks no CURVE, so
replicas whose events use CURVE are not registered (their unsalted requests then score nothing
there). Replica i of --replicas (from 0) is instance i + 1.
"""

from __future__ import annotations

from typing import Any

import httpx2 as httpx

from kvstrata.router.index import Match
from kvstrata.router.replicas import Replica
from kvstrata.router.subscriber import connectable


class DynamoIndexer:
    def __init__(self, url: str, replicas: tuple[str, ...], model_name: str) -> None:
        self.url = url.rstrip("/")
        self.ids = {u: i + 1 for i, u in enumerate(replicas)}
        self.model_name = model_name
        self.client: httpx.AsyncClient | None = None

    async def register(self, rep: Replica) -> None:
        """(Re-)register a joining replica: its old blocks are forgotten, its stream followed."""
        info = rep.info
        if not info or info.get("curve") or self.client is None:
            return
        ident = {"instance_id": self.ids[rep.url], "model_name": self.model_name}
        await self.client.post(f"{self.url}/unregister", json=ident)  # a rejoin starts afresh
        body: dict[str, Any] = {
            **ident,
            "endpoint": connectable(str(info["endpoint"]), rep.url),
            "block_size": int(info["page_size"]),
        }
        if info.get("replay_endpoint"):
            body["replay_endpoint"] = connectable(str(info["replay_endpoint"]), rep.url)
        r = await self.client.post(f"{self.url}/register", json=body)
        if not r.is_success:  # 201 Created
            raise ValueError(f"{self.url}/register of {rep.url}: HTTP {r.status_code}: {r.text}")

    async def matches(
        self, client: httpx.AsyncClient, live: list[Replica], tokens: list[int], page: int
    ) -> dict[str, Match]:
        """Each live replica's match for a prompt's first `tokens` (its hittable pages)."""
        ask = {"token_ids": tokens, "model_name": self.model_name}
        r = await client.post(f"{self.url}/query", json=ask)
        r.raise_for_status()
        return parse_query(r.json(), live, self.ids, page)


def parse_query(
    answer: dict[str, Any], live: list[Replica], ids: dict[str, int], page: int
) -> dict[str, Match]:
    """The /query answer as a Match per live replica (pages; a replica it does not list: none)."""
    found = answer.get("instances") or {}
    own: dict[str, Match] = {}
    for rep in live:
        tiers = found.get(str(ids[rep.url])) or {}
        device = int(tiers.get("gpu", 0)) // page
        host = max(device, int(tiers.get("cpu", 0)) // page)
        own[rep.url] = Match(device, host, max(host, int(tiers.get("disk", 0)) // page))
    out = {}
    for rep in live:  # a shared store's pages count for every replica that reads it
        shared = [own[o.url].storage for o in live if rep.storage and o.storage == rep.storage]
        m = own[rep.url]
        out[rep.url] = Match(m.device, m.host, max([m.storage, *shared]))
    return out

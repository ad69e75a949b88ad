"""A fleet router's decisions: which replica takes each request, and how right it was.

Per request: its prompt's token ids (a token-id prompt as it is; text or chat messages through a
live replica's /tokenize, so they are exactly the replica's), its cache_salt, and its session
identity (the `x-session-id` header, else the OpenAI `user` field, else the cache_salt). The
prompt's block hashes are computed as each replica computes them (its namespace from
/v1/kv/events/info, the salt joined by kvstrata.cache.keys.salted), only over the pages a prompt
may take from a cache (its last token is always computed). Each live replica's matches (the
router's index, or Dynamo's indexer for unsalted requests with --kv-indexer-url) and load go to
the rule (kvstrata/router/rule.py). `round_robin` ignores them and takes the replicas in turn.

The prediction for the chosen replica (its leading pages held anywhere it reads, in tokens) is
compared with the cached_tokens its answer reports (a non-streamed body's usage, or a stream's
usage chunk): the router's /metrics count how often they are equal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx

from kvstrata.cache.events import block_hash
from kvstrata.cache.keys import page_keys, salted
from kvstrata.cache.lease import hittable_pages
from kvstrata.http.errors import ApiError
from kvstrata.router.config import RouterConfig
from kvstrata.router.index import FleetIndex, Match
from kvstrata.router.metrics import FleetMetrics
from kvstrata.router.replicas import Replica, ReplicaPool
from kvstrata.router.rule import Candidate, rank, spread_key
from kvstrata.zmq_curve import CurveKeys

SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class Route:
    """One request's decision: the replicas to try in order, and the cached tokens predicted
    on each."""

    order: list[str]
    predicted: dict[str, int]
    reason: str  # prefix | session | load | round_robin


@dataclass(frozen=True)
class Prompt:
    tokens: list[int] | None  # None: unknown (a body the replicas will refuse)
    salt: str
    session: str | None


class Fleet:
    def __init__(self, cfg: RouterConfig, metrics: FleetMetrics, keys: CurveKeys | None) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.index = FleetIndex()
        self.pool = ReplicaPool(cfg, self.index, metrics, keys)
        self.indexer: Any = None  # kvstrata.router.dynamo.DynamoIndexer with --kv-indexer-url
        self._turn = 0  # round_robin's next replica

    def live(self) -> list[Replica]:
        live = self.pool.live()
        if not live:
            raise ApiError(502, "no replica is up: " + ", ".join(self.pool.replicas))
        return live

    async def route(
        self, client: httpx.AsyncClient, raw: bytes, headers: Mapping[str, str]
    ) -> Route:
        live = self.live()
        self._turn += 1  # round_robin's turn, and whose /tokenize a text prompt uses
        prompt = await self._prompt(client, raw, headers, live[self._turn % len(live)].url)
        matches = await self._matches(client, live, prompt)
        predicted = {
            r.url: matches[r.url].storage * (r.namespace.page_size if r.namespace else 0)
            for r in live
        }
        if self.cfg.routing == "round_robin":
            n = len(live)
            order = [live[(self._turn + i) % n].url for i in range(n)]
            return Route(order, predicted, "round_robin")
        cands = [
            Candidate(r.url, m.device, m.host, m.storage, r.load)
            for r in live
            for m in (matches[r.url],)
        ]
        spread = spread_key(prompt.tokens[: _page_size(live)]) if prompt.tokens else ""
        order = rank(cands, _pages(prompt, live), prompt.session, self.cfg.load_weight, spread)
        held = any(c.storage for c in cands)
        reason = "prefix" if held else "session" if prompt.session is not None else "load"
        return Route(order, predicted, reason)

    # ---- around one request ------------------------------------------------------------------
    def started(self, url: str, route: Route) -> None:
        self.metrics.decisions.labels(reason=route.reason).inc()
        rep = self.pool.replicas.get(url)
        if rep is not None:
            rep.in_flight += 1

    def finished(self, url: str) -> None:
        rep = self.pool.replicas.get(url)
        if rep is not None:
            rep.in_flight = max(0, rep.in_flight - 1)

    def refused(self, url: str) -> None:
        """`url` refused the connection (nothing started there): out of the routing set until
        its /health answers again."""
        self.metrics.retries.labels(replica=url).inc()
        rep = self.pool.replicas.get(url)
        if rep is not None:
            self.pool.leave(rep, "refused a connection")

    def observe(self, route: Route, url: str, usage: Any) -> None:
        """The chosen replica's usage: its cached_tokens against the prediction."""
        try:
            reported = int(usage["prompt_tokens_details"]["cached_tokens"])
        except (TypeError, KeyError, ValueError):
            return
        predicted = route.predicted.get(url, 0)
        self.metrics.predicted_tokens.inc(predicted)
        self.metrics.reported_tokens.inc(reported)
        outcome = "equal" if predicted == reported else "unequal"
        self.metrics.predictions.labels(outcome=outcome).inc()

    def observe_body(self, route: Route, url: str, data: bytes) -> None:
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return
        if isinstance(body, dict) and body.get("usage"):
            self.observe(route, url, body["usage"])

    # ---- internals --------------------------------------------------------------------------------
    async def _prompt(
        self, client: httpx.AsyncClient, raw: bytes, headers: Mapping[str, str], via: str
    ) -> Prompt:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            return Prompt(None, "", headers.get(SESSION_HEADER))
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else ""
        user = body.get("user") if isinstance(body.get("user"), str) else None
        session = headers.get(SESSION_HEADER) or user or salt or None
        return Prompt(await _tokens(client, body, via), salt or "", session)

    async def _matches(
        self, client: httpx.AsyncClient, live: list[Replica], prompt: Prompt
    ) -> dict[str, Match]:
        none = Match(0, 0, 0)
        if prompt.tokens is None:
            return {r.url: none for r in live}
        if self.indexer is not None and not prompt.salt:
            page = next((r.namespace.page_size for r in live if r.namespace is not None), 0)
            usable = hittable_pages(len(prompt.tokens), page) * page if page else 0
            try:
                return await self.indexer.matches(client, live, prompt.tokens[:usable], page)
            except (httpx.HTTPError, ValueError, TypeError) as exc:  # the router's own index then
                self.metrics.indexer_failures.labels(kind=type(exc).__name__).inc()
        out, hashes_by_ns = {}, {}
        for r in live:
            if r.namespace is None:
                out[r.url] = none
                continue
            ns = r.namespace
            if ns not in hashes_by_ns:
                keys = page_keys(prompt.tokens, salted(ns, prompt.salt))
                usable = hittable_pages(len(prompt.tokens), ns.page_size)
                hashes_by_ns[ns] = [block_hash(k) for k in keys[:usable]]
            out[r.url] = self.index.match(r.url, prompt.salt, hashes_by_ns[ns])
        return out


def _page_size(live: list[Replica]) -> int:
    """The fleet's page size (replicas that told theirs; 0 if none did)."""
    return next((r.namespace.page_size for r in live if r.namespace is not None), 0)


def _pages(prompt: Prompt, live: list[Replica]) -> int:
    """The prompt's pages a cache could give (the rule's whole)."""
    if prompt.tokens is None:
        return 0
    sizes = [r.namespace.page_size for r in live if r.namespace is not None]
    return max((hittable_pages(len(prompt.tokens), p) for p in sizes), default=0)


async def _tokens(client: httpx.AsyncClient, body: dict[str, Any], via: str) -> list[int] | None:
    """The prompt's token ids: a token-id prompt as it is, else the replica's /tokenize of the
    text or messages (None when the body has neither or the replica refuses it: the request's
    own replica answers it with its 400)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and all(isinstance(t, int) and t >= 0 for t in prompt):
        return list(prompt) if prompt else None
    if isinstance(prompt, str):
        ask: dict[str, Any] = {"prompt": prompt}
    elif isinstance(body.get("messages"), list):
        ask = {"messages": body["messages"]}
    else:
        return None
    try:
        r = await client.post(f"{via}/tokenize", json=ask)
        return [int(t) for t in r.json()["tokens"]] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None

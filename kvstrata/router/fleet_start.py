"""A fleet router's parts, made at start: the index, the replica pool, and (with --kv-indexer-url)
Dynamo's indexer client, which every replica is registered with (again) as it joins."""

from __future__ import annotations

import asyncio

import httpx2 as httpx
from prometheus_client import CollectorRegistry

from kvstrata.router.config import RouterConfig
from kvstrata.router.dynamo import DynamoIndexer
from kvstrata.router.fleet import Fleet
from kvstrata.router.metrics import FleetMetrics
from kvstrata.zmq_curve import CurveKeys


def make_fleet(cfg: RouterConfig, registry: CollectorRegistry) -> Fleet:
    """The fleet of `cfg.replicas` (its series on `registry`); ValueError for bad key files."""
    keys = None
    if cfg.kv_events_curve_secret_file:
        keys = CurveKeys.load(
            cfg.kv_events_curve_secret_file,
            cfg.kv_events_curve_peers_dir,
            "--router-kv-events-curve-*",
        )
    fleet = Fleet(cfg, FleetMetrics(registry), keys)
    if cfg.kv_indexer_url:
        name = cfg.served_model_name or "kvstrata"
        fleet.indexer = DynamoIndexer(cfg.kv_indexer_url, cfg.replicas, name)
        fleet.pool.on_join.append(fleet.indexer.register)
    return fleet


def start_fleet(fleet: Fleet, headers: dict[str, str]) -> None:
    """Before the router serves, bounded by start_timeout_s: every replica read and joined (or,
    past it, at least one; else ValueError naming why each did not)."""

    async def wait() -> None:
        timeout = httpx.Timeout(fleet.cfg.info_timeout_s, connect=fleet.cfg.connect_timeout_s)
        async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
            use_client(fleet, client)
            await fleet.pool.wait_any(client)

    asyncio.run(wait())


def use_client(fleet: Fleet, client: httpx.AsyncClient) -> None:
    """The HTTP client the fleet's parts talk through from now on (the router's, once it serves)."""
    if fleet.indexer is not None:
        fleet.indexer.client = client

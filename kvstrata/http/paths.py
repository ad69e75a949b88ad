"""The paths one kvstrata server reads of another: named once, for the server that answers and
the one that asks (a router asks workers and replicas, a decode worker its prefill workers)."""

from __future__ import annotations

PD_INFO_PATH = "/v1/pd/info"
"""A worker's P/D role and transfer endpoint (kvstrata.pd.routes)."""
KV_EVENTS_INFO_PATH = "/v1/kv/events/info"
"""What a fleet router needs to index a replica's pages (kvstrata.serve.kv_info)."""

"""The connector seam: how KV computed elsewhere comes in and KV computed here goes out.

The engine calls a connector at fixed points of its step, shaped like vLLM's KV connector
(KVConnectorBase_V1): after admission, `get_finished` starts the loads of newly admitted
remote requests and lands or fails those whose KV arrived (its requests that ended are
returned); during the forward, `save_kv_layer` hears each layer of the prompts the forward
completes, so their pages can leave layer by layer. P/D (kvstrata/pd/) implements it on both
roles; an engine without one computes everything itself.
"""

from __future__ import annotations

from typing import Any

from kvstrata.engine.request import Request


class KVConnector:
    """No-op defaults: a connector overrides what its role needs."""

    def get_finished(self, engine: Any) -> list[Request]:
        """Once per step, after admission: start, land or fail remote work; returns the
        requests it ended (landed to completion, or failed)."""
        return []

    def save_kv_layer(self, reqs: list[Request], layer: int) -> None:
        """Mid-forward: `layer` of these prompts is computed (not while speculating)."""

    @property
    def saves_layers(self) -> bool:
        """Whether save_kv_layer wants each layer (else the forward skips the calls)."""
        return False

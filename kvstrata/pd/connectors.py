"""The P/D roles as KV connector kinds, chosen by name (kvstrata.engine.kv_connector.CONNECTORS).

"pd-prefill": a prefill rank's side (listens on its own endpoint: rank r binds port + r);
"pd-decode": a decode rank's side (asks prefill workers). One factory signature for both:
(PDConfig, Transport, metrics, rank).
"""

from __future__ import annotations

from kvstrata.engine.kv_connector import CONNECTORS, KVConnector
from kvstrata.pd.config import PDConfig
from kvstrata.pd.decode import DecodeSide
from kvstrata.pd.metrics import RankCounts
from kvstrata.pd.prefill import PrefillSide
from kvstrata.pd.transport import Transport


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank r binds port + r (port 0: a free port for each rank)."""
    head, port = endpoint.rsplit(":", 1)
    return endpoint if port in ("0", "*") else f"{head}:{int(port) + rank}"


@CONNECTORS.register("pd-prefill")
def prefill_side(
    cfg: PDConfig, transport: Transport, metrics: RankCounts, rank: int = 0
) -> KVConnector:
    listener = transport.listen(rank_endpoint(cfg.pd_transfer_endpoint, rank))
    return PrefillSide(cfg, listener, metrics, rank)


@CONNECTORS.register("pd-decode")
def decode_side(
    cfg: PDConfig, transport: Transport, metrics: RankCounts, rank: int = 0
) -> KVConnector:
    return DecodeSide(cfg, transport, metrics, rank)


def pd_side(
    role: str, cfg: PDConfig, transport: Transport, metrics: RankCounts, rank: int = 0
) -> PrefillSide | DecodeSide:
    """The side of a P/D worker's `role` ("prefill" or "decode") on `rank`."""
    side = CONNECTORS.create(f"pd-{role}", cfg, transport, metrics, rank)
    assert isinstance(side, PrefillSide | DecodeSide)
    return side

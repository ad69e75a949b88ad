"""The layout a P/D peer must share, read off a built engine."""

from __future__ import annotations

from typing import Any

from kvstrata.engine.engine import Engine
from kvstrata.pd.wire import Layout


def layout_of(
    engine: Engine, tp: int = 1, cp: int = 1, pp: int = 1, shape: Any = None, rank: int = 0
) -> Layout:
    """The layout a peer must share: page shape, dtype, model (and draft) fingerprint, ranks.
    shape: the whole page (a rank's pool holds only its part); rank: the rank that speaks."""
    s, spec = shape if shape is not None else engine.pool.shape, engine.spec
    return Layout(
        page_size=s.page_size,
        dtype=s.dtype,
        model=engine.model.fingerprint,
        draft=spec.fingerprint if spec is not None else "",
        layers=s.num_layers,
        kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        tp=tp,
        cp=cp,
        pp=pp,
        page_bytes=s.page_nbytes,
        rank=rank,
    )

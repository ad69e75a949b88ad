"""A P/D worker inside `kvstrata serve`: its side of the hand-off, wired to the engine loop."""

from __future__ import annotations

from typing import Any

from kvstrata.engine.engine import Engine
from kvstrata.pd.config import PDConfig
from kvstrata.pd.decode import DecodeSide
from kvstrata.pd.prefill import PrefillSide
from kvstrata.pd.routes import PDMetrics
from kvstrata.pd.transport import TRANSPORTS
from kvstrata.pd.wire import Layout


def layout_of(engine: Engine, tp: int = 1, cp: int = 1, pp: int = 1) -> Layout:
    """The layout a peer must share: page shape, dtype, model (and draft) fingerprint, ranks."""
    s, spec = engine.pool.shape, engine.spec
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
    )


class PDWorker:
    """role "prefill" (listens) or "decode" (asks); `attach` runs once the engine is built."""

    def __init__(self, role: str, cfg: PDConfig, metrics: PDMetrics) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"a P/D worker is a prefill or a decode, not {role!r}")
        self.role, self.cfg, self.metrics = role, cfg, metrics
        transport = TRANSPORTS.create(cfg.pd_transport)
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        if role == "prefill":  # bound now: the address is known before the engine is up
            self.prefill = PrefillSide(cfg, transport.listen(cfg.pd_transfer_endpoint), metrics)
        else:
            self.decode = DecodeSide(cfg, transport, metrics)
        self.layout: Layout | None = None

    @property
    def transfer_endpoint(self) -> str:
        return self.prefill.listener.endpoint if self.prefill is not None else ""

    def attach(self, loop: Any, engine: Engine) -> None:
        """On the engine thread, once built: the layout, and the side's hooks/threads."""
        self.layout = layout_of(engine)
        if self.prefill is not None:
            self.prefill.attach(loop, engine, self.layout)
        if self.decode is not None:
            self.decode.attach(engine, self.layout)

    def info(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "transport": self.cfg.pd_transport,
            "transfer_endpoint": self.transfer_endpoint,
            "prefill": self.cfg.prefill_urls if self.role == "decode" else [],
            "layout": self.layout.as_dict() if self.layout is not None else None,
        }

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()

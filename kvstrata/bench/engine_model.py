"""The "engine" replay model: the real Llama/Qwen2 model computes the KV of every missed page.

Cache decisions are the same as with the synthetic model (the replay drives them); here the bytes
moved between tiers are real KV, computed by the model, copied layer by layer, stored and read
back through the chosen storage backend. For small traces: every prompt token is really computed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvstrata.bench.replay import REPLAY_MODELS, ReplayConfig
from kvstrata.cache.ops import PageMover, TransferOp
from kvstrata.engine.build import resolve_model_path
from kvstrata.engine.config import EngineConfig
from kvstrata.memory.pool import DevicePool, HostPool
from kvstrata.memory.transfer import TensorMover
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import SeqBatch
from kvstrata.storage.base import StorageBackend
from kvstrata.workloads.trace import TokenMapper, TraceRequest


@REPLAY_MODELS.register("engine")
class EngineReplayModel:
    """Computes prompt (and mapped output) tokens into the device pages the replay hands out."""

    def __init__(self, cfg: ReplayConfig) -> None:
        self.lm = load_model(resolve_model_path(EngineConfig(model=cfg.model_path)))
        if cfg.vocab_size > self.lm.vocab_size:
            raise ValueError(
                f"vocab_size {cfg.vocab_size} exceeds the model's {self.lm.vocab_size}"
            )
        shape = self.lm.kv_shape(cfg.page_size)
        cc = cfg.cache
        self.page = cfg.page_size
        self.page_nbytes = shape.page_nbytes
        self.device = DevicePool(shape, cc.device_pages)
        self.host = HostPool(shape, cc.host_pages) if cc.host_pages else None
        self.tokens = TokenMapper(cfg.vocab_size)
        self._mover: TensorMover | None = None

    virtual_time = False  # real copies and storage reads: the replay waits on wall time

    def mover(self, storage: StorageBackend | None, clock: Callable[[], float]) -> PageMover:
        self._mover = TensorMover(self.device, self.host, storage)
        return self._mover

    def prefill(
        self, req: TraceRequest, hit_tokens: int, page_ids: list[int], load: TransferOp | None
    ) -> None:
        """Compute tokens [hit_tokens, full pages) into `page_ids`; wait for the host load per
        layer."""
        toks = self.tokens.prompt_tokens(req)
        if req.output is not None:
            toks = np.concatenate([toks, np.asarray(req.output, dtype=np.int32)])
        end = len(page_ids) * self.page
        if end > self.lm.spec.max_position_embeddings:
            raise ValueError(f"request {req.rid}: {end} tokens exceed the model's positions")
        handle = load.handle if load is not None else None
        if end <= hit_tokens:
            if handle is not None:
                handle.wait()
            return
        batch = SeqBatch.build([toks[hit_tokens:end].tolist()], [hit_tokens], [page_ids])
        before = handle.wait_layer if handle is not None else None
        self.lm(batch, self.device, before_layer=before, last_only=True)

    def kv_of(self, page_ids: list[int]) -> torch.Tensor:
        """[layers, 2, pages, page, heads, dim] copy of device pages (tests)."""
        return self.device.data[:, :, page_ids].clone()

    def close(self) -> None:
        if self._mover is not None:
            self._mover.close()

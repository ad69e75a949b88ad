"""The model runner: a scheduled batch in, logits rows and sampled tokens out.

It waits for the batch's host -> device loads layer by layer (the KV manager names them), runs the
draft's proposals, the target forward (decodes verifying drafts in a forward of their own, all
rows kept) and the draft's catch-up, and reports each finished layer of completed prompts to a
connector around each layer (P/D prefill sends a layer's pages at once). It changes no request
state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvstrata.engine.kv_manager import KVManager
from kvstrata.engine.request import Request, State
from kvstrata.engine.scheduler import Work
from kvstrata.engine.speculative import Speculator
from kvstrata.memory.pool import DevicePool
from kvstrata.model import step_ops
from kvstrata.model.decoder import DecoderLM, SeqBatch


class LayerHooks(Protocol):
    """Called around each target layer of a forward (kvstrata.engine.kv_connector.KVConnector,
    its step's metadata bound)."""

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int) -> None: ...


@dataclass
class Forward:
    """What one forward gave, per work item (same order as the batch)."""

    rows: list[torch.Tensor]  # [1, vocab] (last token), or [n+1, vocab] verifying n drafts
    hidden: list[torch.Tensor | None]  # last-layer states [its tokens, hidden] (MTP only)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # rid -> drafted tokens


class ModelRunner:
    """Runs the model (any part of it: a TP shard, a PP stage, a CP rank) over a batch."""

    def __init__(
        self, model: DecoderLM, pool: DevicePool, kv: KVManager, spec: Speculator | None
    ) -> None:
        self.model, self.pool, self.kv, self.spec = model, pool, kv, spec

    def run(self, work: Work, layer_done: LayerHooks | None = None) -> Forward:
        reqs = [r for r, _ in work]
        wait = self.kv.layer_wait(reqs)
        started = time.perf_counter()
        drafts = self.spec.propose(work, self.pool, wait) if self.spec is not None else {}
        drafting = time.perf_counter() - started
        hidden: list[torch.Tensor] | None = [] if self.spec and self.spec.wants_hidden else None
        rows = self._logits(work, drafts, wait, layer_done, hidden)
        hid: list[torch.Tensor | None] = list(hidden) if hidden else [None] * len(work)
        if self.spec is not None:
            items = zip(work, hid, strict=True)
            prefills = [(r, h) for (r, _), h in items if r.state is State.PREFILL]
            started = time.perf_counter()
            self.spec.after_forward(prefills, self.pool, wait)  # type: ignore[arg-type]
            self.spec.stats.draft_s += drafting + time.perf_counter() - started
        self.kv.loaded(reqs)  # waited for, layer by layer, in this forward
        return Forward(rows, hid, drafts)

    def sample(self, req: Request, row: torch.Tensor) -> int:
        """The request's next token from its logits row [vocab]: greedy, or its sampler's."""
        return step_ops.argmax(row) if req.sampler is None else req.sampler.sample(row)

    def _logits(
        self,
        work: Work,
        drafts: dict[str, list[int]],
        wait: Callable[[int], None] | None,
        layer_done: LayerHooks | None,
        hidden: list[torch.Tensor] | None,
    ) -> list[torch.Tensor]:
        """Target logits per work item. Verifies run in a forward of their own (all rows kept).
        `hidden` (if given) gets each item's last-layer states [its tokens, hidden]."""
        plain = [i for i, (r, _) in enumerate(work) if not drafts.get(r.rid)]
        out: list[torch.Tensor] = [torch.empty(0)] * len(work)
        hid: list[torch.Tensor] = [torch.empty(0)] * len(work)
        for idx, last_only in (
            (plain, True),
            ([i for i in range(len(work)) if i not in plain], False),
        ):
            if not idx:
                continue
            items = [work[i] for i in idx]
            toks = [t + drafts.get(r.rid, []) for r, t in items]
            batch = SeqBatch.build(
                toks, [r.computed for r, _ in items], [r.page_table for r, _ in items]
            )
            before, last = self._layer_hooks(wait, layer_done if last_only else None)
            states: list[torch.Tensor] = []
            # hidden_out only when asked (an MTP head): the TP / PP / CP forwards all take it
            extra = {"hidden_out": states} if hidden is not None else {}
            logits = self.model(batch, self.pool, before_layer=before, last_only=last_only, **extra)
            if last is not None:
                last()
            parts = logits.split(1) if last_only else logits.split(batch.seq_lens)
            for i, part in zip(idx, parts, strict=True):
                out[i] = part
            if hidden is not None:
                for i, h in zip(idx, states[0].split(batch.seq_lens), strict=True):
                    hid[i] = h
            wait = None  # every pending load was waited for, layer by layer
        if hidden is not None:
            hidden.extend(hid)
        return out

    def _layer_hooks(
        self, wait: Callable[[int], None] | None, hooks: LayerHooks | None
    ) -> tuple[Callable[[int], None] | None, Callable[[], None] | None]:
        """`before_layer` that also waits for the connector's loads and reports each finished
        layer (layer i - 1 is written when layer i starts), and the report of the last layer
        after the forward."""
        if hooks is None:
            return wait, None

        def before(i: int) -> None:
            if wait is not None:
                wait(i)
            hooks.wait_for_layer_load(i)
            if i:
                hooks.save_kv_layer(i - 1)

        last = self.pool.shape.num_layers - 1  # this rank's layers (a pp stage has a part)
        return before, lambda: hooks.save_kv_layer(last)

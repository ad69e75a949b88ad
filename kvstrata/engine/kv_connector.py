"""The connector seam: how KV computed elsewhere comes in and KV computed here goes out.

Shaped like vLLM's KV connector (KVConnectorBase_V1). The engine and its scheduler call it at
fixed points:
0. `add_request`: a request entered the engine (every rank alike, at the step it arrived),
   before its checks; one the engine refuses is then ended at once (`request_finished`, with
   `req.failure` set).
1. admission: after the KV manager matched a request over the local tiers (and allocated its
   pages), `get_num_new_matched_tokens` says how many further prompt tokens another worker
   provides; `update_state_after_alloc` hands over the request's device pages (a connector with
   remote tokens starts fetching them). A request with remote tokens waits in
   State.WAITING_FOR_REMOTE_KV: it holds its pages but the scheduler plans none of its prompt.
2. `get_finished` (once per step, after admission): what landed (Landed) or failed
   (RemoteFailed), which the engine resumes or ends, and which held requests the connector is
   done with (`Finished.sent`), whose pages the engine then frees.
3. `build_connector_meta`: the per-step metadata of the planned batch, which the engine binds
   before the forward; the runner then calls `wait_for_layer_load` before and `save_kv_layer`
   after each layer (P/D prefill sends a layer's pages as soon as it is computed).
4. `request_finished`: a request ended (finished, failed, aborted or refused), after its full
   computed pages were cached and before anything is freed. It returns whether the connector
   still reads the request's pages (vLLM's delay_free): if so the engine holds them (the
   request's lease stays open: its pages are neither freed, evicted nor reused) until
   `get_finished` names the request in `Finished.sent`, or until an abort of the request
   (`drop_held` first, so the connector reads them no more); else they go back at once.
Everything a connector may use of its engine comes through `register_kv_caches` (an EngineView).
Connector kinds are chosen by name through CONNECTORS ("pd-prefill", "pd-decode").
An engine without a connector computes everything itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstrata.engine.request import Request
from kvstrata.registry import Registry

if TYPE_CHECKING:
    from kvstrata.engine.kv_manager import KVManager
    from kvstrata.engine.speculative import Speculator
    from kvstrata.memory.pool import DevicePool


@dataclass(frozen=True)
class EngineView:
    """What a connector may use of its engine (given once, by register_kv_caches)."""

    pool: DevicePool
    """The device pages remote KV is written into and local KV is read from."""
    kv: KVManager
    """Key chains, held keys, hits and pending loads of a request (the lease's owner)."""
    clock: Callable[[], float]
    """The engine's decision clock (under ranks the agreed one: rank 0's time)."""
    spec: Speculator | None
    """The speculator, when decoding speculatively (its state travels with a hand-off)."""

    @property
    def page_size(self) -> int:
        return self.pool.shape.page_size


@dataclass(frozen=True)
class Landed:
    """A request's remote KV is in its pages: the engine resumes it.

    tokens: leading prompt tokens whose KV is in the request's pages now (they count as
    computed and are cached as a computed chunk is); None: nothing came, the engine computes
    the prompt from its own hits on. logits: the prompt's last logits row [vocab] when the
    whole prompt came (the engine emits the first token from it); state: the prefill worker's
    speculator hand-off state for it."""

    req: Request
    tokens: int | None
    logits: torch.Tensor | None = None
    state: torch.Tensor | None = None


@dataclass(frozen=True)
class RemoteFailed:
    """A request's remote KV will not come: it ends with HTTP `status` and `message`."""

    req: Request
    status: int
    message: str


RemoteDone = Landed | RemoteFailed


@dataclass(frozen=True)
class Finished:
    """What `get_finished` reports for one step (vLLM's finished_recving / finished_sending).

    remote: requests whose remote KV landed or failed, in the order they are applied.
    sent: ids of held requests (request_finished returned True) whose pages the connector reads
    no more (sent, or given up on): the engine frees them now."""

    remote: list[RemoteDone] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ConnectorMeta:
    """One step's connector metadata (a connector extends it with what its runner side needs).

    per_layer: the runner calls wait_for_layer_load / save_kv_layer at every layer."""

    per_layer: bool = False


@dataclass(frozen=True)
class SaveMeta(ConnectorMeta):
    """Prompts this forward completes whose layers leave as they are computed."""

    saves: list[Request] = field(default_factory=list)


class KVConnector:
    """No-op defaults: a connector overrides what its role needs."""

    meta: ConnectorMeta = ConnectorMeta()

    # ---- set up ----------------------------------------------------------------------------------
    def register_kv_caches(self, view: EngineView) -> None:
        """Once, when the engine takes the connector."""

    # ---- scheduler side -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """A request entered the engine (before its checks; every rank at the same step)."""

    def get_num_new_matched_tokens(self, req: Request, local_tokens: int) -> int:
        """Prompt tokens beyond the `local_tokens` the local tiers hold that another worker
        provides (0: the engine computes the rest itself)."""
        return 0

    def update_state_after_alloc(self, req: Request, pages: list[int], remote_tokens: int) -> None:
        """The request's device pages (logical page -> device page) after its admission."""

    def build_connector_meta(self, work: list[tuple[Request, list[int]]]) -> ConnectorMeta:
        """The metadata of the step that runs `work` (each request and the tokens it feeds)."""
        return ConnectorMeta()

    def get_finished(self, idle_wait_s: float) -> Finished:
        """Once per step, after admission: the requests whose remote KV landed or failed, and
        the held requests this connector is done with. idle_wait_s: nothing else to do this
        step; the connector may block that long for an arrival."""
        return Finished()

    def request_finished(self, req: Request) -> bool:
        """A request ended (finished, failed, aborted, or refused at submit: req.failure); its
        pages are still its own during this call. True: the connector reads them after this
        call, and the engine holds them until `get_finished` reports the request sent; False:
        they go back at once."""
        return False

    def drop_held(self, req: Request) -> None:
        """The engine takes back a held request's pages before the connector reported it sent
        (an abort): returns once no read of them is under way, and none starts after."""

    # ---- runner side ----------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        self.meta = meta

    def clear_connector_metadata(self) -> None:
        self.meta = ConnectorMeta()

    def wait_for_layer_load(self, layer: int) -> None:
        """Before `layer` runs: its remote KV is in place."""

    def save_kv_layer(self, layer: int) -> None:
        """After `layer` ran: its KV of the bound metadata's requests is final."""


CONNECTORS: Registry[KVConnector] = Registry("kv connector")
"""Connector kinds by name ("pd-prefill", "pd-decode": kvstrata/pd/connectors.py)."""

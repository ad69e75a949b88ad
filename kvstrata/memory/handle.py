"""Completion of one queued copy: per layer (so compute can start on layer 0), then the whole op."""

from __future__ import annotations

import threading

import torch


class TransferHandle:
    """Completion of one queued copy op: per layer, then the whole op."""

    def __init__(
        self,
        kind: str,
        num_pages: int,
        nbytes: int,
        num_layers: int,
        cuda_device: torch.device | None,
    ) -> None:
        self.kind = kind  # "load" (host -> device) or "store" (device -> host)
        self.num_pages = num_pages
        self.nbytes = nbytes
        self.num_layers = num_layers
        # CPU: set once the layer's bytes are copied. CUDA: set once its copies are enqueued and
        # its cuda event recorded (the bytes land when that event completes).
        self._layer_set = [threading.Event() for _ in range(num_layers)]
        self._cuda_device = cuda_device
        self._cuda_events = [torch.cuda.Event() for _ in range(num_layers)] if cuda_device else None
        self._error: BaseException | None = None
        self._failed_from = num_layers  # layers >= this did not complete

    @property
    def error(self) -> BaseException | None:
        return self._error

    def complete_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """The copier is done with layer `layer` (CUDA: its copies are enqueued on `stream`, whose
        point here the layer's event records). Called by the copy worker only."""
        if self._cuda_events is not None:
            self._cuda_events[layer].record(stream)
        self._layer_set[layer].set()

    def _fail(self, layer: int, exc: BaseException) -> None:
        """Record the error first, then wake every waiter of the unfinished layers."""
        self._error = exc
        self._failed_from = layer
        for ev in self._layer_set[layer:]:
            ev.set()

    def _wait_set(self, layer: int, timeout: float | None) -> None:
        if not self._layer_set[layer].wait(timeout):
            raise TimeoutError(f"{self.kind}: layer {layer} not done after {timeout} s")
        if self._error is not None and layer >= self._failed_from:
            raise RuntimeError(f"{self.kind} failed at layer {self._failed_from}") from self._error

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Layer `layer` is usable: CPU blocks; CUDA makes the current stream wait on it."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        self._wait_set(layer, timeout)
        if self._cuda_events is not None:
            torch.cuda.current_stream(self._cuda_device).wait_event(self._cuda_events[layer])

    def wait(self, timeout: float | None = None) -> None:
        """Block the host until every layer is copied; re-raises a worker error."""
        if self.num_layers:
            self._wait_set(self.num_layers - 1, timeout)
            if self._cuda_events is not None:
                self._cuda_events[-1].synchronize()  # events on one stream complete in order

    def is_done(self) -> bool:
        """True once the op finished (successfully or not: see `error`)."""
        if not self._layer_set[-1].is_set():
            return False
        return self._cuda_events is None or self._error is not None or self._cuda_events[-1].query()

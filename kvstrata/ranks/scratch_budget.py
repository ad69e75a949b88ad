"""The context-parallel term of the scheduler's batch budget: the per-layer gather's scratch."""

from __future__ import annotations

from kvstrata.engine.request import Request
from kvstrata.memory.cp_ownership import CPOwnership
from kvstrata.memory.pool import DevicePool
from kvstrata.model_parallel.cp_gather import scratch_nbytes


class ScratchBudget:
    """The CP budget term of the scheduler (kvstrata.engine.scheduler.BatchLimit): both
    (recv, scratch) buffer pairs of the per-layer gather (kvstrata.model_parallel.cp_gather.
    scratch_nbytes) stay within `scratch_bytes` (0: no limit).

    The scheduler drops requests from the end of the planned batch until it fits (the first
    always runs); they wait for a later step. The plan depends only on agreed state, so every
    rank trims alike.
    """

    def __init__(self, pool: DevicePool, scratch_bytes: int) -> None:
        if scratch_bytes < 0:
            raise ValueError(f"scratch_bytes must be >= 0 (0 = no limit), got {scratch_bytes}")
        self.pool, self.scratch_bytes = pool, scratch_bytes
        self.page = pool.shape.page_size
        self.peak = 0  # largest planned scratch of any forward (bytes)

    def batch_scratch(self, work: list[tuple[Request, list[int]]]) -> int:
        """Bytes of both gather buffer pairs for this batch."""
        shape, cp = self.pool.shape, self.pool.n_shards
        pages: dict[int, None] = {}
        for req, toks in work:
            ctx = req.computed + len(toks)
            pages.update(dict.fromkeys(req.page_table[: -(-ctx // self.page)]))
        shares = CPOwnership(cp).shares(list(pages))
        return scratch_nbytes(shape.layer_page_numel * shape.itemsize, len(pages), max(shares), cp)

    def fits(self, work: list[tuple[Request, list[int]]]) -> bool:
        return not self.scratch_bytes or self.batch_scratch(work) <= self.scratch_bytes

    def planned(self, work: list[tuple[Request, list[int]]]) -> None:
        self.peak = max(self.peak, self.batch_scratch(work))

"""Messages between the connector's scheduler side and its workers (one step's work, results).

Scheduler -> workers (StepJobs, inside vLLM's connector metadata): the page moves the cache
manager started this step, with kvstrata's device page ids already turned into vLLM block ids.
Workers -> scheduler (OpResults, inside vLLM's connector stats): pages each op moved; under
tensor parallelism vLLM aggregates the workers' results and the agreed count is the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockCopy:
    """One kvstrata page <-> the vLLM blocks it covers (page_size = r x block_size).

    `blocks[j]` is the vLLM block holding tokens [j*block, (j+1)*block) of the page, or (loads
    only) -1 where that block is not copied (vLLM computed it itself, or it is already in place).
    A store always reads every block of its page.
    """

    host_id: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class CopyJob:
    """Host -> vLLM (load) or vLLM -> host (store) pages of one op."""

    op_id: int
    pages: tuple[BlockCopy, ...]
    requests: tuple[str, ...] = ()  # the vLLM requests whose blocks these are (for errors)


@dataclass(frozen=True)
class StorageJob:
    """Storage work of one op: probe (host_ids empty), backup (host -> storage) or prefetch (storage
    -> host)."""

    op_id: int
    kind: str
    keys: tuple[int, ...]
    host_ids: tuple[int, ...] = ()


@dataclass
class StepJobs:
    """Everything the workers do for the cache this step, in this order: storage jobs, loads
    (before the forward), stores (after it: the forward writes the blocks they read)."""

    storage: list[StorageJob] = field(default_factory=list)
    loads: list[CopyJob] = field(default_factory=list)
    stores: list[CopyJob] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)
    """vLLM blocks promised as loaded that the scheduler side could not load: recomputed."""
    finished_sending: list[str] = field(default_factory=list)
    """Finished requests whose blocks vLLM keeps for this step's stores (request_finished said
    delay_free); the workers report them back once the stores ran, and vLLM frees the blocks."""

    def __bool__(self) -> bool:
        return bool(
            self.storage or self.loads or self.stores or self.failed_blocks or self.finished_sending
        )

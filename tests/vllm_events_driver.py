"""Run by tests/test_vllm_events.py under .venv-vllm (vLLM's types): the connector's two sides,
real vLLM requests and scheduler outputs, real KV tensors, a file store; prints the KV events.

The driver plays vLLM's engine loop for one worker: schedule, build the connector metadata, run
the worker's jobs around a (skipped) forward, hand the worker's results back, drain the events.
Output: one JSON line per take_events batch, each event as [type, hashes, parent, n_tokens, medium]
(a stored one also with its extra_keys and block_size). Request b carries a cache_salt.
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.distributed.kv_events import BlockStored
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvstrata.integrations.vllm.config import VllmConnectorConfig
from kvstrata.integrations.vllm.connector import vllm_event
from kvstrata.integrations.vllm.kv_manager import VllmKVManager
from kvstrata.integrations.vllm.spec import KVSpec
from kvstrata.integrations.vllm.worker import WorkerSide

SPEC = KVSpec(4, 4, 2, 1, 1, 8, "float32", "events-test")  # block = page = 4 tokens


class Engine:
    def __init__(self, storage_url: str) -> None:
        config = VllmConnectorConfig(host_pages=2, storage_url=storage_url, check_integrity=True)
        self.sched = VllmKVManager(config, SPEC, kv_events=True)
        self.worker = WorkerSide(config, SPEC, tp_rank=0)
        self.worker.register({f"layer.{i}": torch.randn(8, 1, 4, 16) for i in range(2)})

    def step(self, out: SchedulerOutput) -> None:
        jobs = self.sched.build_connector_meta(out)
        self.worker.before_forward(jobs)
        self.worker.after_forward(jobs)
        self.sched.report(self.worker.take_results())
        events = [vllm_event(c, SPEC.page_size) for c in self.sched.take_tier_changes()]
        if events:
            print(json.dumps([encode(e) for e in events]), flush=True)

    def serve(self, request: Request, blocks: list[int]) -> None:
        """Admit (asking again while storage answers), prefill in one step, finish."""
        for _ in range(8):
            matched, _ = self.sched.num_new_matched_tokens(request, 0)
            if matched is not None:
                break
            self.step(SchedulerOutput.make_empty())
        assert matched == 0, matched
        self.sched.update_state_after_alloc(request, blocks, 0)
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(request, (blocks,))]
        out.num_scheduled_tokens = {request.request_id: request.num_tokens}
        out.total_num_scheduled_tokens = request.num_tokens
        self.step(out)
        self.sched.request_finished(request)
        for _ in range(3):  # the store lands in host memory, then its write-through backup
            self.step(SchedulerOutput.make_empty())


def encode(event: object) -> list[object]:
    if isinstance(event, BlockStored):
        extra = [list(k) if k else None for k in event.extra_keys or []]
        return ["stored", event.block_hashes, event.parent_block_hash, len(event.token_ids),
                event.medium, extra, event.block_size]  # fmt: skip
    return ["removed", event.block_hashes, None, 0, event.medium]  # type: ignore[attr-defined]


def main() -> None:
    engine = Engine(sys.argv[1])
    for rid, first in (("a", 100), ("b", 200)):  # b's 2 pages push a's out of 2 host pages
        prompt = list(range(first, first + 10))
        salt = "tenant-b" if rid == "b" else None
        request = Request(rid, prompt, SamplingParams(max_tokens=1), None, cache_salt=salt)
        engine.serve(request, [0, 1, 2])
    engine.sched.close()
    engine.worker.close()


if __name__ == "__main__":
    main()

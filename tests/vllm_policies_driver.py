"""Run by tests/test_vllm_write_policies.py under .venv-vllm (vLLM's request and scheduler-output
types): the connector's two sides over real KV tensors play vLLM's engine loop for one write
policy and one scenario; prints one JSON object of what happened, step by step.

Scenarios (page = block = 4 tokens, prompts of 10 tokens: 2 full pages):
- "two": request a is prefilled; while it runs, b (same prompt, vLLM's own hit of 8 tokens on
  a's blocks) is admitted and prefilled; then a finishes, then b.
- "preempted": a is prefilled, then vLLM preempts it (its blocks are free again) and it is
  aborted while waiting.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvstrata.integrations.vllm.config import VllmConnectorConfig
from kvstrata.integrations.vllm.kv_manager import VllmKVManager
from kvstrata.integrations.vllm.metadata import BlockCopy
from kvstrata.integrations.vllm.spec import KVSpec
from kvstrata.integrations.vllm.worker import WorkerSide

SPEC = KVSpec(4, 4, 2, 1, 1, 8, "float32", "policies-test")
PROMPT = list(range(100, 110))
SCRATCH = 15  # a vLLM block no request uses: host pages are loaded back into it to compare


class Engine:
    def __init__(self, policy: str) -> None:
        config = VllmConnectorConfig(
            host_pages=8, write_policy=policy, write_through_threshold=1, check_integrity=True
        )
        self.sched = VllmKVManager(config, SPEC)
        self.worker = WorkerSide(config, SPEC, tp_rank=0)
        self.kv = {f"layer.{i}": torch.randn(16, 1, 4, 16) for i in range(2)}
        self.worker.register(self.kv)
        self.log: list[dict[str, Any]] = []
        self.exact = True  # every stored host page equals the vLLM block it was read from

    def step(self, out: SchedulerOutput, note: str) -> None:
        jobs = self.sched.build_connector_meta(out)
        self.worker.before_forward(jobs)
        self.worker.after_forward(jobs)
        self.sched.report(self.worker.take_results())
        stored = [(p.host_id, p.blocks[0]) for job in jobs.stores for p in job.pages]
        for host_id, block in stored:
            self.check_bytes(host_id, block)
        sent = sorted(self.worker.take_finished_sending())
        self.log.append({"step": note, "stored_pages": len(stored), "finished_sending": sent})

    def check_bytes(self, host_id: int, block: int) -> None:
        assert self.worker.blocks is not None
        self.worker.blocks.copy(self.worker.host, [BlockCopy(host_id, (SCRATCH,))], to_vllm=True)
        for t in self.kv.values():
            self.exact &= bool(torch.equal(t[SCRATCH], t[block]))

    def admit(self, request: Request, blocks: list[int], vllm_hit: int) -> None:
        matched, _ = self.sched.num_new_matched_tokens(request, vllm_hit)
        assert matched == 0, matched  # no storage, nothing in host memory past vLLM's hit
        self.sched.update_state_after_alloc(request, blocks, 0)
        request.num_computed_tokens = vllm_hit

    def prefill(self, request: Request, blocks: list[int], note: str) -> None:
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(request, (blocks,))]
        todo = request.num_tokens - request.num_computed_tokens
        out.num_scheduled_tokens = {request.request_id: todo}
        out.total_num_scheduled_tokens = todo
        self.step(out, note)
        request.num_computed_tokens = request.num_tokens

    def finish(self, request: Request, note: str) -> None:
        delay = self.sched.request_finished(request)
        self.log.append({"step": note, "delay_free": delay})
        self.step(SchedulerOutput.make_empty(), f"after {note}")
        self.sched.check_integrity()


def request(rid: str) -> Request:
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=1), None)


def two(engine: Engine) -> None:
    a, b = request("a"), request("b")
    engine.admit(a, [0, 1, 2], 0)
    engine.prefill(a, [0, 1, 2], "prefill a")
    engine.admit(b, [0, 1, 3], 8)  # vLLM shares a's two full blocks
    engine.prefill(b, [0, 1, 3], "prefill b")
    engine.finish(a, "finish a")
    engine.finish(b, "finish b")


def preempted(engine: Engine) -> None:
    a = request("a")
    engine.admit(a, [0, 1, 2], 0)
    engine.prefill(a, [0, 1, 2], "prefill a")
    out = SchedulerOutput.make_empty()
    out.preempted_req_ids = {"a"}
    engine.step(out, "preempt a")
    engine.finish(a, "abort a")


def run(policy: str, scenario: str) -> dict[str, Any]:
    engine = Engine(policy)
    SCENARIOS[scenario](engine)
    engine.sched.check_integrity()
    engine.worker.check_integrity()
    host = engine.sched.cache.tiers.host
    assert host is not None
    engine.sched.close()
    engine.worker.close()
    return {
        "policy": policy,
        "scenario": scenario,
        "log": engine.log,
        "exact": engine.exact,
        "host_pages_used": host.capacity - host.num_free,
    }


SCENARIOS = {"two": two, "preempted": preempted}


def main() -> None:
    """Every policy named on the command line, every scenario: one JSON line each."""
    for policy in sys.argv[1:]:
        for scenario in SCENARIOS:
            print(json.dumps(run(policy, scenario)), flush=True)


if __name__ == "__main__":
    main()

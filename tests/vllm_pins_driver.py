"""Run by tests/test_vllm_pins.py under .venv-vllm (vLLM's request and scheduler-output types):
a request whose kv_transfer_params pin its prompt keeps its pages in the connector's host tier
through a storm of other requests; a later request with the same prompt loads them from host
memory, byte for byte. Prints one JSON object."""

from __future__ import annotations

import json
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request
from vllm_policies_driver import PROMPT, Engine


def request(rid: str, prompt: list[int], params: dict[str, Any] | None = None) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(rid, list(prompt), SamplingParams(max_tokens=1, extra_args=extra), None)


def run_one(engine: Engine, req: Request, blocks: list[int]) -> None:
    engine.admit(req, blocks, 0)
    engine.prefill(req, blocks, f"prefill {req.request_id}")
    engine.finish(req, f"finish {req.request_id}")


def main() -> None:
    engine = Engine("write_through")  # host tier of 8 pages: pins may keep 4
    run_one(engine, request("a", PROMPT, {"kv_pin_s": 300}), [0, 1, 2])
    run_one(engine, request("bad", [7] * 10, {"kv_pin_s": "soon"}), [3, 4, 5])  # ignored
    for k in range(6):  # 12 pages of other prompts through the 6 unpinned host pages
        run_one(engine, request(f"s{k}", list(range(200 + 10 * k, 210 + 10 * k))), [3, 4, 5])
    sched = engine.sched
    s0, _ = sched.num_new_matched_tokens(request("s0b", list(range(200, 210))), 0)
    again = request("a2", PROMPT)
    matched, _ = sched.num_new_matched_tokens(again, 0)
    sched.update_state_after_alloc(again, [6, 7, 8], matched or 0)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(again, ([6, 7, 8],))]
    out.num_scheduled_tokens = {"a2": len(PROMPT) - (matched or 0)}
    out.total_num_scheduled_tokens = len(PROMPT) - (matched or 0)
    engine.step(out, "prefill a2")  # the load of the pinned pages runs before the forward
    loaded = all(torch.equal(t[6], t[0]) and torch.equal(t[7], t[1]) for t in engine.kv.values())
    sched.check_integrity()
    pins = sched.cache.counters.pins
    print(json.dumps({
        "a2_matched": matched, "s0_matched": s0, "loaded_exact": loaded,
        "stored_exact": engine.exact, "made": pins.made, "pinned": sched.cache.pins.pinned,
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

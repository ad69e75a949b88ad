"""Replay with the real model: same cache decisions as the synthetic model, and the KV that the
tiers hand back equals the KV computed from scratch."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstrata.bench.replay import ReplayConfig, Replayer
from kvstrata.memory.pool import DevicePool
from kvstrata.model.decoder import SeqBatch
from kvstrata.workloads.trace import TraceRequest
from tests.test_replay import small_trace
from tests.tiny_models import rel_err

torch.set_num_threads(1)


CKPT = {"seed": 4, "max_position_embeddings": 4096}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def test_engine_replay_matches_synthetic_and_recompute(ckpt: Path) -> None:
    trace = small_trace(20, seed=2, max_blocks=2)
    # wait_complete: the hits do not depend on how long storage reads take (synthetic vs real time)
    base = dict(page_size=16, vocab_size=97, prefetch_policy="wait_complete")
    synth = Replayer(ReplayConfig.sized(16 * 80, 16 * 120, "mem://", **base))
    engine = Replayer(
        ReplayConfig.sized(
            16 * 80, 16 * 120, "mem://", model="engine", model_path=str(ckpt), **base
        )
    )
    s_res, e_res = synth.run(trace), engine.run(trace)
    tiers = [(o.rid, o.prompt, o.device, o.host, o.storage) for o in s_res.outcomes]
    assert tiers == [(o.rid, o.prompt, o.device, o.host, o.storage) for o in e_res.outcomes]
    assert e_res.hit_tokens_by_tier()["host"] > 0  # the run spilled and came back from host memory
    assert e_res.hit_tokens_by_tier()["storage"] > 0
    # every device page the tree holds equals the KV computed from scratch for its tokens
    req: TraceRequest = trace.requests[-1]
    keys = engine.keys.keys(req)
    m = engine.cache.match(keys)
    assert m.device_pages > 0
    lm = engine.model.lm  # type: ignore[attr-defined]
    toks = engine.model.tokens.prompt_tokens(req)[: m.device_pages * 16].tolist()  # type: ignore[attr-defined]
    fresh = DevicePool(lm.kv_shape(16), m.device_pages)
    lm(SeqBatch.build([toks], [0], [list(range(m.device_pages))]), fresh, last_only=True)
    cached = engine.model.kv_of(m.device_ids)  # type: ignore[attr-defined]
    assert rel_err(cached, fresh.data) <= 1e-4
    synth.close()
    engine.close()

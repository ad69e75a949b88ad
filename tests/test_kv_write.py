"""K/V page writes: slice copies per run of consecutive pages, index_copy_ for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.memory.pool import DevicePool
from kvstrata.model import page_runs as runs_mod
from kvstrata.model.attn_meta import build_meta
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM, SeqBatch
from kvstrata.model.page_runs import MIN_SPAN_ROWS, write_plan
from tests.tiny_models import hf_logits, load_hf, make_llama, rel_err

torch.set_num_threads(1)
PAGE, TOL = 4, 1e-4


def t(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids)


def test_write_plan_exact() -> None:
    assert MIN_SPAN_ROWS == 16  # 4 pages of 4 tokens: the shortest span written as a slice
    # one run of 5 pages, 20 new rows at positions 0..19: one slice from flat slot 3 * 4
    plan = write_plan([t([3, 4, 5, 6, 7])], [20], [20], [True], PAGE)
    assert plan.spans == [(12, 0, 20)] and plan.rest is None
    # two runs of 4 pages, then one page of 2 rows: too short, so those rows are the rest
    plan = write_plan([t([3, 4, 5, 6, 10, 11, 12, 13, 0])], [34], [34], [True], PAGE)
    assert plan.spans == [(12, 0, 16), (40, 16, 16)] and plan.rest.tolist() == [32, 33]
    # a chunk after 6 cached tokens starts mid-page: slot 4 * 4 + 2 of page 4
    plan = write_plan([t([3, 4, 5, 6, 7, 8])], [18], [24], [True], PAGE)
    assert plan.spans == [(18, 0, 18)] and plan.rest is None
    # batch: a decode token (rest), that chunk (rows 1..18), a non-tail sequence (rest)
    tables, lens, ctx = (
        [t([9]), t([3, 4, 5, 6, 7, 8]), t([0, 1, 2, 10, 11])],
        [1, 18, 17],
        [3, 24, 20],
    )
    plan = write_plan(tables, lens, ctx, [True, True, False], PAGE)
    assert plan.spans == [(18, 1, 18)] and plan.rest.tolist() == [0, *range(19, 36)]
    # only short runs (pages reversed), or a decode batch: no spans, every row index_copy_'d
    assert write_plan([t([7, 6, 5, 4, 3])], [20], [20], [True], PAGE).spans == []
    assert write_plan([t([1]), t([2])], [1, 1], [2, 3], [True, True], PAGE).spans == []


def test_write_plan_too_many_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runs_mod, "MIN_SPAN_ROWS", 1)
    monkeypatch.setattr(runs_mod, "MAX_SPANS", 2)
    assert write_plan([t([5, 6, 0])], [12], [12], [True], PAGE).spans == [(20, 0, 8), (0, 8, 4)]
    assert write_plan([t([5, 0, 6])], [12], [12], [True], PAGE).spans == []


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("kvw"), seed=4, max_position_embeddings=256)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# per sequence: page table, tokens cached before, new tokens. Sequence 0 continues a chunk over
# one run of pages, 1 is a first chunk over runs of 4 pages and one stray page, 2 is one
# decode token, 3 a first chunk on pages reversed (no run long enough)
TABLES = [list(range(10)), [20, 21, 22, 23, 24, 30, 31, 32, 33, 9], [40], [19, 18, 17]]
STEPS = [([0, 0, 0, 0], [22, 40, 3, 12]), ([22, 40, 3, 12], [17, 0, 1, 0])]


def _run(model: DecoderLM, kv_dtype: str, spans: bool, mp: pytest.MonkeyPatch) -> tuple:
    """Pool bytes and logits after STEPS; spans=False forces index_copy_ for every row."""
    mp.setattr(runs_mod, "MAX_SPANS", runs_mod.MAX_SPANS if spans else -1)
    pool = DevicePool(model.kv_shape(PAGE, kv_dtype), 48)
    toks = [tokens(40, seed=s) for s in range(len(TABLES))]
    out, used = [], []
    for cached, new in STEPS:
        live = [s for s, n in enumerate(new) if n]
        batch = SeqBatch.build(
            [toks[s][cached[s] : cached[s] + new[s]] for s in live],
            [cached[s] for s in live],
            [t(TABLES[s]) for s in live],
        )
        meta = build_meta(batch.positions, batch.seq_lens, batch.ctx_lens, batch.page_tables, 4)
        used.append(len(meta.spans))
        out.append(model(batch, pool))
    pool.check_integrity()
    return pool.data.clone(), torch.cat(out), used, toks


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_pool_bytes_equal_index_copy(
    model_path: Path, kv_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slice writes leave the pool byte-equal to index_copy_ on contiguous, fragmented and
    mixed batches, and the logits equal (fp32: HF's forward of each sequence)."""
    model = load_model(model_path)
    data, logits, used, toks = _run(model, kv_dtype, True, monkeypatch)
    ref_data, ref_logits, ref_used, _ = _run(model, kv_dtype, False, monkeypatch)
    # spans: seq 0's run and seq 1's two runs (its stray page index_copy_'d), then seq 0's
    # continuing chunk (the decode token index_copy_'d)
    assert used == [3, 1] and ref_used == [0, 0]
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(logits, ref_logits)
    if kv_dtype == "float32":
        hf = load_hf(model_path)
        rows = {0: [(0, 22, 0), (77, 94, 22)], 1: [(22, 62, 0)], 2: [(62, 65, 0), (94, 95, 3)]}
        for s, parts in rows.items():  # (first row, end row, first position) of each part
            ref = hf_logits(hf, toks[s][: STEPS[1][0][s] + STEPS[1][1][s]])
            for a, b, p in parts:
                assert rel_err(logits[a:b], ref[p : p + b - a]) <= TOL

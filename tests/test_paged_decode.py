"""Batched decode attention from the pages where they are (model/_paged_decode.c).

The kernel against softmax attention over gathered K/V (fp32 and bf16 pools, fragmented page
tables, sequences of different lengths, contexts whole or in chunks merged by log-sum-exp, every
build of the chunk kernel this CPU can run: AVX-512, AVX2, portable; a verify's several rows per
sequence under its causal rule), and a model's batched decode step and verify rows against
transformers per sequence, with no gather and no per-sequence attention kernel in the step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvstrata.memory.pool import DevicePool
from kvstrata.model import paged_decode as pd
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import SeqBatch
from tests.tiny_models import hf_logits, load_hf, make_llama, rel_err

torch.set_num_threads(1)
TOL = 1e-4


class Ops(TorchDispatchMode):
    """Counts the aten ops run under it by name."""

    def __init__(self) -> None:
        super().__init__()
        self.n: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, ctx: int
) -> torch.Tensor:  # [heads, dim]
    """One sequence's attention over its gathered K/V, in fp32."""
    kv_heads, dim = k.shape[2:]
    ks, vs = (
        p[table].reshape(-1, kv_heads, dim)[:ctx].float().transpose(0, 1)[None] for p in (k, v)
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return sdpa(q[None, :, None], ks, vs, enable_gqa=True)[0, :, 0]


BUILDS = ("avx512", "avx2", "portable")


def test_native_kernel_is_built() -> None:
    assert pd.available() and pd.isa() in BUILDS


def test_the_best_build_the_cpu_has_runs() -> None:
    """avx512 where the CPU has avx512f (with avx2 and fma), else avx2, else portable."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = next(
        (set(line.split(":", 1)[1].split()) for line in cpuinfo.read_text().splitlines()
         if line.startswith("flags")),
        set(),
    )  # fmt: skip
    best = "portable"
    if {"avx2", "fma"} <= flags:
        best = "avx512" if "avx512f" in flags else "avx2"
    assert pd.isa() == best


def runnable_builds() -> list[str]:
    """The builds this CPU runs: the best it has and every one below it."""
    return list(BUILDS[BUILDS.index(pd.isa()) :]) if pd.available() else []


@pytest.fixture(params=BUILDS)
def build(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each build of the chunk kernel, capped by use_isa (skipped where the CPU lacks it)."""
    if request.param not in runnable_builds():
        pytest.skip(f"this CPU has no {request.param}")
    pd.use_isa(request.param)
    try:
        yield request.param
    finally:
        pd.use_isa(None)


def test_builds_can_be_capped_and_released() -> None:
    best = pd.isa()
    for name in runnable_builds():
        pd.use_isa(name)
        try:
            assert pd.isa() == name
        finally:
            pd.use_isa(None)
    assert pd.isa() == best
    with pytest.raises(ValueError, match="use_isa takes"):
        pd.use_isa("sse9")
    if best != "avx512":
        with pytest.raises(ValueError, match="this CPU has no avx512"):
            pd.use_isa("avx512")


# (heads, kv_heads, head_dim): SmolLM2's grouping (the vector builds where the CPU has them),
# 8 heads per group on a 128-wide head (the AVX-512 V sum in two passes of 64 columns), 7 per
# group on a 48-wide head (a V pass narrower than its registers), and shapes only the portable
# build takes (head_dim not a multiple of 16; 16 heads per group)
SHAPES = [(9, 3, 64), (8, 1, 128), (14, 2, 48), (6, 2, 24), (16, 1, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_pages", [0, 1, 3, 100])
def test_kernel_equals_gathered_attention(
    dtype: torch.dtype, threads: int, shape: tuple[int, int, int], chunk_pages: int, build: str
) -> None:
    """chunk_pages 0: the kernel's own choice; 1 and 3: many chunks, a last one part full; 100:
    every context one chunk."""
    gen = torch.Generator().manual_seed(3)
    (heads, kv_heads, dim), cap, page = shape, 64, 16
    k = torch.randn(cap, page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(cap, page, kv_heads, dim, generator=gen).to(dtype)
    lens = [1, 5, 16, 17, 100, 300]
    tables = [torch.randperm(cap, generator=gen)[: -(-c // page)] for c in lens]
    q = torch.randn(len(lens), heads, dim, generator=gen)
    torch.set_num_threads(threads)
    try:
        out = pd.paged_decode(q, k, v, pd.flat_tables(tables), torch.tensor(lens), chunk_pages)
    finally:
        torch.set_num_threads(1)
    assert out.shape == q.shape and out.dtype == q.dtype
    for s, ctx in enumerate(lens):
        assert rel_err(out[s], reference(q[s], k, v, tables[s], ctx)) <= TOL


# (heads, kv_heads, head_dim, rows): SmolLM2's verify of one draft token (2 x 3 queries per K/V
# head: the AVX-512 four-key scoring), 3 rows of 4 heads per group (12, the most the vector
# builds take), and 5 rows of SmolLM2's 3 (15 > 12 per K/V head: shared by the portable build,
# one row at a time by a vector build, see shares_rows)
ROW_SHAPES = [(9, 3, 64, 2), (8, 2, 32, 3), (9, 3, 64, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize(("chunk_pages", "threads"), [(1, 2), (0, 1)])
def test_rows_of_a_sequence_share_one_read(
    dtype: torch.dtype, shape: tuple[int, int, int, int], chunk_pages: int, threads: int, build: str
) -> None:
    """R query rows per sequence in one call, row r seeing positions 0 .. ctx - R + r: each row
    equals attention over its own visible K/V. Contexts whose last rows cross a page (and with
    chunk_pages 1 a chunk) boundary, so that a chunk holds only keys some rows may not see; a
    row that sees no key at all (a context shorter than R: the padding of a shorter sequence)
    gives zeros."""
    gen = torch.Generator().manual_seed(4)
    (heads, kv_heads, dim, rows), cap, page = shape, 64, 16
    k = torch.randn(cap, page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(cap, page, kv_heads, dim, generator=gen).to(dtype)
    lens = [rows - 1, rows, 17, 33, 64 + rows - 1, 300]
    tables = [torch.randperm(cap, generator=gen)[: -(-c // page)] for c in lens]
    q = torch.randn(len(lens) * rows, heads, dim, generator=gen)
    torch.set_num_threads(threads)
    try:
        out = pd.paged_decode(
            q, k, v, pd.flat_tables(tables), torch.tensor(lens), chunk_pages, rows=rows
        )
    finally:
        torch.set_num_threads(1)
    assert out.shape == q.shape and out.dtype == q.dtype
    for s, ctx in enumerate(lens):
        for r in range(rows):
            got, seen = out[s * rows + r], ctx - rows + r + 1
            if seen <= 0:
                assert torch.equal(got, torch.zeros_like(got))
                continue
            assert rel_err(got, reference(q[s * rows + r], k, v, tables[s], seen)) <= TOL


def test_rows_are_shared_unless_they_fall_to_the_portable_build(build: str) -> None:
    """Rows x group <= 12 queries per K/V head on a 64-wide head stay in the vector builds; 15
    would fall to the portable one, so a vector build takes them one row at a time."""
    assert pd.shares_rows(3, 2, 64) and pd.shares_rows(3, 4, 64)
    assert pd.shares_rows(3, 5, 64) == (build == "portable")
    assert pd.shares_rows(3, 5, 24)  # a shape only the portable build takes: always shared


def test_kernel_rejects_bad_shapes() -> None:
    k = torch.zeros(4, 4, 3, 8)
    q = torch.zeros(1, 4, 8)  # 4 query heads over 3 K/V heads
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        pd.paged_decode(q, k, k, pd.flat_tables([torch.tensor([0])]), torch.tensor([1]))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama"), seed=1)


def test_batched_decode_step_equals_transformers(ckpt: Path) -> None:
    """Three sequences of different lengths on scattered pages decode one token each in one
    forward: logits equal transformers' per sequence; no gather, no sdpa in the step."""
    model, hf = load_model(ckpt), load_hf(ckpt)
    pool = DevicePool(model.kv_shape(4), 32)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (3, 9, 22)]
    tables = [[5], [30, 2, 17], [1, 9, 3, 28, 12, 7]]
    for toks, table in zip(prompts, tables, strict=True):
        model(SeqBatch.build([toks], [0], [table]), pool)
    nxt = [[11], [42], [77]]
    batch = SeqBatch.build(nxt, [len(p) for p in prompts], tables)
    with Ops() as ops:
        got = model(batch, pool, last_only=True)  # [3, vocab]
    assert ops.n["index_select"] == 0 and ops.n["scaled_dot_product_attention"] == 0
    assert ops.n["_scaled_dot_product_flash_attention_for_cpu"] == 0
    for s, toks in enumerate(prompts):
        ref = hf_logits(hf, [*toks, *nxt[s]])[-1]
        assert rel_err(got[s], ref) <= TOL


def test_verify_rows_are_batched_decode_queries(ckpt: Path) -> None:
    """A speculative verify's few rows per sequence (3, 1 and 2 here: the shorter ones padded
    to 3 rows) run as queries sharing one read of their sequence's pages, row i seeing the
    positions up to its own: every row's logits equal transformers'; no gather of K/V, no sdpa
    in the step."""
    model, hf = load_model(ckpt), load_hf(ckpt)
    pool = DevicePool(model.kv_shape(4), 32)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (13, 9, 22)]
    tables = [[4, 20, 8, 6, 0], [30, 2, 17], [1, 9, 3, 28, 12, 7, 21]]
    for toks, table in zip(prompts, tables, strict=True):
        model(SeqBatch.build([toks], [0], [table]), pool)
    nxt = [[11, 5, 60], [42], [77, 3]]
    batch = SeqBatch.build(nxt, [len(p) for p in prompts], tables)
    with Ops() as ops:
        got = model(batch, pool)  # [6, vocab]
    assert ops.n["index_select"] == 0 and ops.n["scaled_dot_product_attention"] == 0
    assert ops.n["_scaled_dot_product_flash_attention_for_cpu"] == 0
    row = 0
    for toks, new in zip(prompts, nxt, strict=True):
        ref = hf_logits(hf, [*toks, *new])[len(toks) :]
        for i in range(len(new)):
            assert rel_err(got[row + i], ref[i]) <= TOL
        row += len(new)


BF16_TOL = 2e-2  # bf16 keeps 8 mantissa bits (0.4% a rounding); measured 0.36-0.46% here


def test_bf16_model_and_pages_follow_transformers_bf16(ckpt: Path) -> None:
    """bf16 weights and bf16 pages: a prompt, then batched decode steps of two sequences,
    within BF16_TOL (max abs error / max abs logit) of transformers in bf16; the steps' linears
    all run in the native few-row kernel (model/small_matmul.py)."""
    from transformers import AutoModelForCausalLM

    model = load_model(ckpt, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).eval()
    pool = DevicePool(model.kv_shape(4), 16)
    assert pool.data.dtype == torch.bfloat16 and model.kv_shape(4).dtype == "bfloat16"
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (6, 13)]
    tables = [[3, 9], [0, 14, 5, 7]]
    for toks, table in zip(prompts, tables, strict=True):
        model(SeqBatch.build([toks], [0], [table]), pool)
    seqs = [list(p) for p in prompts]
    for step in range(2):
        nxt = [[(17 * step + 5 * s) % 97] for s in range(2)]
        with Ops() as ops:
            got = model(SeqBatch.build(nxt, [len(x) for x in seqs], tables), pool, last_only=True)
        # every linear of the step (the LM head too) by the native few-row kernel, none by torch
        assert not {"linear", "mm", "addmm", "matmul"} & set(ops.n), {
            "linear",
            "mm",
            "addmm",
            "matmul",
        } & set(ops.n)
        for s in range(2):
            seqs[s] += nxt[s]
            ref = hf_logits(hf, seqs[s])[-1]
            assert rel_err(got[s], ref) <= BF16_TOL, (step, s, rel_err(got[s], ref))

"""Fused projections (q/k/v and gate/up as one matmul each) and in-place page reads.

Every variant is checked against transformers' own forward at 1e-4 and against the unfused
model; matmul and gather counts are exact, so a fast path that silently stopped running fails.
"""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvstrata.memory.pool import DevicePool
from kvstrata.model import page_runs as runs_mod
from kvstrata.model import small_matmul
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM, SeqBatch
from kvstrata.model.page_runs import MAX_RUNS, MIN_RUN_TOKENS, page_runs
from kvstrata.model_parallel.tp import shard_tp
from kvstrata.ranks.config import DistConfig
from kvstrata.ranks.group import RankContext, run_ranks
from tests.tiny_models import hf_logits, load_hf, make_llama, make_qwen2, rel_err

torch.set_num_threads(1)
PAGE, TOL, LAYERS = 4, 1e-4, 2
FUSED_MM = 4 * LAYERS + 1  # per forward: qkv, o, gate_up, down per layer; the LM head
UNFUSED_MM = 7 * LAYERS + 1  # q, k, v, o, gate, up, down per layer; the LM head


class Ops(TorchDispatchMode):
    """Counts the aten ops a forward runs; every matmul (linear, mm, addmm, oneDNN's
    prepacked linear, the native few-row kernel) as "mm", the prepacked ones also as "packed",
    the native ones also as "small"."""

    def __init__(self) -> None:
        super().__init__()
        self.n: Counter[str] = Counter()
        self._kernel = small_matmul.small_linear

    def __enter__(self) -> Ops:
        def counted(*args: Any) -> torch.Tensor:
            self.n["mm"] += 1
            self.n["small"] += 1
            return self._kernel(*args)

        small_matmul.small_linear = counted  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        small_matmul.small_linear = self._kernel  # type: ignore[assignment]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name == "_linear_pointwise":
            self.n["packed"] += 1
        self.n["mm" if name in ("linear", "mm", "addmm", "_linear_pointwise") else name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def ckpts(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one architecture with different weights (seed 1 and 2)."""
    make = make_qwen2 if request.param == "qwen2" else make_llama
    kw = {} if request.param == "qwen2" else {"attention_bias": True, "mlp_bias": True}
    return tuple(  # type: ignore[return-value]
        make(tmp_path_factory.mktemp(f"{request.param}{s}"), seed=s, **kw) for s in (1, 2)
    )


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_then_decode(
    model: Any, toks: list[int], table: list[int], split: int = 9
) -> tuple[torch.Tensor, Counter[str]]:
    """Logits of toks[:split] (first chunk), the rest as a continued chunk, then one decode
    step; and the ops of the decode step. Returns [len(toks) + 1, vocab]."""
    pool = DevicePool(model.kv_shape(PAGE), 16)
    n = len(toks)
    a = model(SeqBatch.build([toks[:split]], [0], [table]), pool)
    b = model(SeqBatch.build([toks[split:]], [split], [table]), pool)
    nxt = int(b[-1].argmax())
    with Ops() as ops:
        c = model(SeqBatch.build([[nxt]], [n], [table]), pool)
    return torch.cat([a, b, c]), ops.n


def unfused_copy(model: DecoderLM) -> DecoderLM:
    plain = DecoderLM(model.spec, model.dtype_name)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def test_fused_equals_unfused_and_hf(ckpts: tuple[Path, Path]) -> None:
    fused, hf = load_model(ckpts[0]), load_hf(ckpts[0])
    plain = unfused_copy(fused)
    assert sorted(fused.state_dict()) == sorted(plain.state_dict())  # HF names, nothing extra
    toks, table = tokens(15, seed=3), [2, 3, 4, 5, 6]
    got, ops = prefill_then_decode(fused, toks, table)
    want, plain_ops = prefill_then_decode(plain, toks, table)
    assert (ops["mm"], plain_ops["mm"]) == (FUSED_MM, UNFUSED_MM)
    assert (ops["packed"], plain_ops["packed"]) == (FUSED_MM, 0)  # every matmul prepacked
    ref = hf_logits(hf, [*toks, int(got[len(toks) - 1].argmax())])
    assert rel_err(got, ref) <= TOL and rel_err(want, ref) <= TOL
    assert rel_err(got, want) <= TOL


def test_prepack_off_runs_the_fused_matmuls_of_torch(ckpts: tuple[Path, Path]) -> None:
    model = load_model(ckpts[0], prepack=False)
    got, ops = prefill_then_decode(model, tokens(15, seed=3), [2, 3, 4, 5, 6])
    assert ops["mm"] == FUSED_MM and ops["packed"] == 0
    packed, _ = prefill_then_decode(load_model(ckpts[0]), tokens(15, seed=3), [2, 3, 4, 5, 6])
    assert rel_err(packed, got) <= TOL


def test_weights_replaced_after_fuse_are_used(ckpts: tuple[Path, Path]) -> None:
    """Assigned weights (new tensors) fall back to the parts; copied-in weights stay fused.
    Either way no prepacked copy of the old weights runs, until fuse() packs the new ones."""
    other, hf = load_model(ckpts[1]), load_hf(ckpts[1])
    toks, table = tokens(15, seed=4), [7, 8, 9, 10, 11]
    ref = hf_logits(hf, toks)
    for assign, mm in ((True, UNFUSED_MM), (False, FUSED_MM)):
        model = load_model(ckpts[0])
        state = {k: v.clone() for k, v in other.state_dict().items()}
        model.load_state_dict(state, assign=assign)
        got, ops = prefill_then_decode(model, toks, table)
        assert ops["mm"] == mm and ops["packed"] == 0
        assert rel_err(got[: len(toks)], ref) <= TOL
    model.fuse()  # the copied-in weights packed anew
    got, ops = prefill_then_decode(model, toks, table)
    assert ops["packed"] == FUSED_MM and rel_err(got[: len(toks)], ref) <= TOL
    mlp = model.model.layers[1].mlp
    mlp.up_proj = torch.nn.Linear(64, 112, bias=mlp.gate_proj.bias is not None)
    _, ops = prefill_then_decode(model, toks, table)
    assert ops["mm"] == FUSED_MM + 1  # layer 1's MLP back on its parts: a new module
    mlp.up_proj = torch.nn.Linear(64, 112, bias=mlp.gate_proj.bias is None)
    model.fuse()  # only some of gate/up with a bias: that MLP stays on its parts
    _, ops = prefill_then_decode(model, toks, table)
    assert ops["mm"] == FUSED_MM + 1
    mlp.up_proj = torch.nn.Linear(64, 112, bias=mlp.gate_proj.bias is not None)
    model.fuse()
    _, ops = prefill_then_decode(model, toks, table)
    assert ops["mm"] == FUSED_MM


def _held_bytes(model: DecoderLM) -> int:
    """Bytes of the distinct storages the model's parameters hold (placeholders hold none)."""
    held = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    return sum(n for ptr, n in held.items() if ptr)


def test_prepacked_linears_hold_no_plain_copy(ckpts: tuple[Path, Path]) -> None:
    """Prepacked, every projection's plain weight is released (a meta placeholder) and the
    checkpoint file is no longer mapped: the packed copy is the only one. The plain weights
    come back bit-exactly through the state dict and a move; the logits equal transformers'
    throughout; a linear packed alone still runs when called directly, a fused part and an
    in-place edit of a placeholder are refused with a clear error."""
    model = load_model(ckpts[0])
    gc.collect()
    mapped = (ckpts[0] / "model.safetensors").resolve()
    assert str(mapped) not in Path("/proc/self/maps").read_text()  # a plain model maps it
    plain = load_model(ckpts[0], prepack=False)
    released = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    assert released and all(n.endswith("_proj.weight") for n in released)
    kept = [p for n, p in plain.named_parameters() if not n.endswith("_proj.weight")]
    assert _held_bytes(model) == sum(p.nbytes for p in kept)  # embedding, norms, biases only
    assert _held_bytes(plain) == sum(p.nbytes for p in plain.parameters())
    want = plain.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    toks, table = tokens(15, seed=3), [2, 3, 4, 5, 6]
    got, ops = prefill_then_decode(model, toks, table)
    ref = hf_logits(load_hf(ckpts[0]), [*toks, int(got[len(toks) - 1].argmax())])
    assert ops["packed"] == FUSED_MM and rel_err(got, ref) <= TOL
    attn, plain_attn = model.model.layers[0].self_attn, plain.model.layers[0].self_attn
    x = torch.randn(3, attn.o_proj.in_features)
    assert rel_err(attn.o_proj(x), plain_attn.o_proj(x)) <= TOL  # packed alone: callable
    with pytest.raises(RuntimeError, match="plain weight was released"):
        attn.q_proj(torch.randn(3, attn.q_proj.in_features))  # a fused part: refused
    moved = model.to("cpu")  # a move unpacks: plain weights back, only the head stays packed
    assert _held_bytes(moved) == _held_bytes(plain)
    got, ops = prefill_then_decode(moved, toks, table)
    assert ops["packed"] == 1 and rel_err(got, ref) <= TOL
    edited = load_model(ckpts[0])
    edited.model.layers[0].self_attn.o_proj.weight.copy_(
        want["model.layers.0.self_attn.o_proj.weight"]
    )
    with pytest.raises(RuntimeError, match="edited in place"):
        prefill_then_decode(edited, toks, table)


def _tp_logits(ctx: RankContext, path: Path, toks: list[int]) -> tuple[list, int, bool]:
    full = load_model(path)
    local = shard_tp(full, ctx.config.tp, ctx.tp_rank, ctx.tp_group)
    s, r = full.spec, ctx.tp_rank
    attn = local.model.layers[0].self_attn
    full_state, at = full.state_dict(), "model.layers.0.self_attn."  # plain weights re-derived
    q, kv = s.num_heads // 2 * s.head_dim, s.num_kv_heads // 2 * s.head_dim
    parts = [
        full_state[at + "q_proj.weight"][r * q : (r + 1) * q],
        full_state[at + "k_proj.weight"][r * kv : (r + 1) * kv],
        full_state[at + "v_proj.weight"][r * kv : (r + 1) * kv],
    ]
    assert attn.fused is not None and attn.fused.packed is not None
    same = torch.equal(attn.fused.packed.dense(), torch.cat(parts))  # this rank's slices, fused
    logits, ops = prefill_then_decode(local, toks, [0, 1, 2, 3, 4])
    # o_proj and down_proj are all-reduce wrappers there: their own forward, not prepacked
    assert ops["packed"] == 2 * LAYERS + 1
    return logits.tolist(), ops["mm"], same


def test_tp_shards_run_fused(ckpts: tuple[Path, Path]) -> None:
    """tp=2 on 2 real gloo ranks: each rank's slices fused, logits equal HF's."""
    toks = tokens(15, seed=5)
    cfg = DistConfig(tp=2, backend="gloo")
    results = run_ranks(_tp_logits, cfg, (ckpts[0], toks), timeout_s=120)
    ref = hf_logits(load_hf(ckpts[0]), toks)
    for logits, mm, same in results:
        assert same and mm == FUSED_MM
        assert rel_err(torch.tensor(logits)[: len(toks)], ref) <= TOL


def test_page_runs_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.tensor
    # the run-length rule at its real value: 64-token pages, 2 runs of 4 pages are too short
    # on average, 2 runs of 8 pages long enough; one run is always kept
    page, half = 64, MIN_RUN_TOKENS // 64
    short = t([*range(half // 2), *range(40, 40 + half // 2)])
    long = t([*range(half), *range(40, 40 + half)])
    ctx = [half * page, 2 * half * page, half // 2 * page]
    assert page_runs([short, long, short[: half // 2]], ctx, page) == [
        None,
        [(0, half), (40, half)],
        [(0, half // 2)],
    ]
    monkeypatch.setattr(runs_mod, "MIN_RUN_TOKENS", 1)  # the run structure itself
    tables = [t([3, 4, 5]), t([7, 2]), t([9]), t([5, 6, 1]), t([11, 0, 1, 2])]
    ctx = [12, 5, 1, 8, 13]  # the 4th uses 2 of its 3 pages
    assert page_runs(tables, ctx, 4) == [
        [(3, 3)],
        [(7, 1), (2, 1)],
        [(9, 1)],
        [(5, 2)],
        [(11, 1), (0, 3)],
    ]
    scattered = t(list(range(0, 2 * (MAX_RUNS + 1), 2)))  # MAX_RUNS + 1 runs of one page
    assert page_runs([scattered, t([4, 5])], [4 * (MAX_RUNS + 1), 8], 4) == [None, [(4, 2)]]


# (table, min tokens per run, index_selects in the decode step): one run; two runs (merged,
# in place); two runs too short (K and V gathered in each layer); too many runs (gathered)
CASES = [
    ([4, 5, 6, 7, 8], MIN_RUN_TOKENS, 0),
    ([10, 11, 0, 1, 2], 1, 0),
    ([10, 11, 0, 1, 2], 11, 2 * LAYERS),
    ([8, 6, 4, 2, 0, 14, 12, 10, 15], 1, 2 * LAYERS),
]


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("table,min_run,gathers", CASES)
def test_page_runs_are_read_in_place(
    ckpts: tuple[Path, Path],
    table: list[int],
    min_run: int,
    gathers: int,
    native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode and continued chunks read runs of consecutive pages in place, no gather; the
    native batched decode kernel reads every page in place, however fragmented."""
    monkeypatch.setattr(runs_mod, "MIN_RUN_TOKENS", min_run)  # tiny pages here
    model, hf = load_model(ckpts[0]), load_hf(ckpts[0])
    for layer in model.model.layers:
        layer.self_attn.native_decode = native
    gathers = 0 if native else gathers
    n = 4 * len(table) - 1  # + 1 decoded: every page of the table used
    toks = tokens(n, seed=6)
    assert MAX_RUNS < 9
    got, ops = prefill_then_decode(model, toks, table)
    assert ops["index_select"] == gathers
    ref = hf_logits(hf, [*toks, int(got[len(toks) - 1].argmax())])
    assert rel_err(got, ref) <= TOL

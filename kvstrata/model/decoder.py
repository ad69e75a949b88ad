"""Llama-family decoder (LlamaForCausalLM, Qwen2ForCausalLM) over a paged KV pool.

One forward runs several sequences at once, their tokens flattened ("varlen"): the linear layers
see all T tokens together, attention runs per sequence against that sequence's pages. Parameter
names equal the Hugging Face ones, so a checkpoint's state dict loads as is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from kvstrata.memory.layout import DTYPES, KVShape
from kvstrata.model import small_matmul
from kvstrata.model.attention import PagedAttention
from kvstrata.model.attn_meta import AttnMeta, build_meta
from kvstrata.model.layers import RMSNorm, Rotary, SwiGLU
from kvstrata.model.prepack import Prepacked


class KVPool(Protocol):
    """What the model needs of a pool (kvstrata.memory.pool.DevicePool satisfies it)."""

    def k(self, layer: int) -> torch.Tensor: ...  # [capacity, page_size, kv_heads, head_dim]
    def v(self, layer: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelSpec:
    """Architecture hyper-parameters, parsed from a checkpoint's config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # None = plain RoPE
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 2048


@dataclass
class SeqBatch:
    """One forward over several sequences, tokens flattened (see docs/CONTRACTS.md)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, absolute positions
    seq_lens: list[int]  # new tokens per sequence (sum = T)
    ctx_lens: list[int]  # tokens of each sequence after this forward (cached + new)
    page_tables: list[torch.Tensor] = field(default_factory=list)  # per seq [ceil(ctx/page)]

    @classmethod
    def build(
        cls,
        new_tokens: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        page_tables: Sequence[torch.Tensor | Sequence[int]],
        device: str | torch.device = "cpu",
    ) -> SeqBatch:
        """Batch that appends `new_tokens[s]` after `cached_lens[s]` cached tokens of sequence s."""
        lens = [len(t) for t in new_tokens]
        # whole sequences at a time (no per-token Python): ids flattened, positions c .. c+n-1
        ids = [torch.as_tensor(toks, dtype=torch.long) for toks in new_tokens]
        pos = [torch.arange(c, c + n) for c, n in zip(cached_lens, lens, strict=True)]
        return cls(
            input_ids=torch.cat(ids).to(device) if ids else torch.empty(0, dtype=torch.long),
            positions=torch.cat(pos).to(device) if pos else torch.empty(0, dtype=torch.long),
            seq_lens=lens,
            ctx_lens=[c + len(t) for t, c in zip(new_tokens, cached_lens, strict=True)],
            page_tables=[torch.as_tensor(p, dtype=torch.long, device=device) for p in page_tables],
        )

    def validate(self, page_size: int, capacity: int) -> None:
        """ValueError naming the field for a batch the model cannot run correctly."""
        t = self.input_ids.shape[0]
        if self.input_ids.dim() != 1 or self.positions.shape != self.input_ids.shape:
            raise ValueError("SeqBatch.input_ids and positions must be 1-D of equal length")
        n = len(self.seq_lens)
        if not n or len(self.ctx_lens) != n or len(self.page_tables) != n:
            raise ValueError(
                "SeqBatch.seq_lens, ctx_lens, page_tables must be equal non-empty lists"
            )
        if sum(self.seq_lens) != t or min(self.seq_lens) < 1:
            raise ValueError(
                f"SeqBatch.seq_lens must be >= 1 each and sum to T={t}: {self.seq_lens}"
            )
        for s, (m, ctx, table) in enumerate(
            zip(self.seq_lens, self.ctx_lens, self.page_tables, strict=True)
        ):
            if ctx < m:
                raise ValueError(f"SeqBatch.ctx_lens[{s}]={ctx} < seq_lens[{s}]={m}")
            if table.dim() != 1 or table.shape[0] * page_size < ctx:
                raise ValueError(f"SeqBatch.page_tables[{s}] has too few pages for ctx {ctx}")
        ids = torch.cat([p.to(self.positions.device) for p in self.page_tables])
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < capacity:
            raise ValueError(f"SeqBatch.page_tables hold page ids outside [0, {capacity})")
        lens = torch.tensor(self.seq_lens, device=self.positions.device)
        ctx_of = torch.repeat_interleave(torch.tensor(self.ctx_lens, device=lens.device), lens)
        if t and bool(((self.positions < 0) | (self.positions >= ctx_of)).any()):
            raise ValueError("SeqBatch.positions must lie in [0, ctx_len) of their sequence")


@dataclass(frozen=True)
class ForwardArgs:
    """One forward call of a model part (the whole model, a pipeline stage, a cp rank)."""

    batch: SeqBatch
    kv: Any  # KVPool (a DevicePool; sharded under cp)
    before_layer: Callable[[int], None] | None = None
    """Called before each layer (local index) runs: e.g. wait for its pages from host memory."""
    last_only: bool = False  # logits of each sequence's last token only
    hidden_out: list[torch.Tensor] | None = None  # gets the last layer's output [T, hidden]


class ModelPart:
    """The forward call every model part takes; each part says how it runs (`run`)."""

    def __call__(
        self,
        batch: SeqBatch,
        kv: Any,
        before_layer: Callable[[int], None] | None = None,
        last_only: bool = False,
        hidden_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self.run(ForwardArgs(batch, kv, before_layer, last_only, hidden_out))

    def run(self, a: ForwardArgs) -> torch.Tensor:
        raise NotImplementedError


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). `attn` and `mlp` default to GQA
    paged attention and SwiGLU; another architecture passes its own (latent attention, MoE)."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        s = spec
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.self_attn = attn or PagedAttention(
            s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.qkv_bias, s.o_bias, dtype
        )
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.mlp = mlp or SwiGLU(s.hidden_size, s.intermediate_size, s.mlp_bias, dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttnMeta,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, hidden], or [len(rows), hidden]: only `rows` go on past attention (every row's
        K/V is still written; see PagedAttention.forward)."""
        h = self.self_attn(self.input_layernorm(x), *rope, k_pool, v_pool, meta, rows)
        # x + h a new tensor (the caller's x is not written), normed in the same pass
        x, normed = self.post_attention_layernorm.add_norm(x if rows is None else x[rows], h)
        return x.add_(self.mlp(normed))


class _Backbone(nn.Module):
    """Holds the HF-named `model.*` parameters (embed_tokens, layers, norm)."""

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, make_layer: Callable[[int], nn.Module]
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(make_layer(i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)


class DecoderLM(nn.Module):
    """A causal LM whose attention reads and writes a paged KV pool; inference only."""

    def __init__(self, spec: ModelSpec, dtype: str = "float32") -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.spec = spec
        self.dtype_name = dtype
        self.fingerprint = ""  # set by checkpoint.load_model: identity of the weights
        tdtype = DTYPES[dtype]
        self.model = _Backbone(spec, tdtype, lambda i: self.make_layer(i, tdtype))
        self.rotary = self.make_rotary()
        self.lm_head: nn.Linear | None = None
        self.head_packed: Prepacked | None = None  # the LM head in oneDNN's layout (fuse)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=tdtype)
        self.requires_grad_(False)  # inference only: pool writes must never join a graph

    def make_layer(self, index: int, dtype: torch.dtype) -> nn.Module:
        """Decoder layer `index` (an architecture with other layers overrides this)."""
        return DecoderLayer(self.spec, dtype)

    def make_rotary(self) -> Rotary:
        """The rotary tables every layer shares."""
        s = self.spec
        return Rotary(s.head_dim, s.rope_theta, s.rope_scaling)

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def fuse(self, prepack: bool = True) -> DecoderLM:
        """q/k/v and gate/up of every layer as one matmul each (call after the weights are
        loaded; the state dict keeps its Hugging Face names); `prepack`: every linear also in
        oneDNN's layout where it can be used (model/prepack.py). Returns self."""
        for layer in self.model.layers:
            layer.self_attn.fuse(prepack)
            layer.mlp.fuse(prepack)
        return self.pack_head(prepack)

    def pack_head(self, prepack: bool = True) -> DecoderLM:
        """The LM head in oneDNN's layout (`prepack`), its plain weight kept: tied, it is the
        embedding; untied, the MTP head and context parallelism read it directly."""
        self.head_packed = Prepacked.build(self._head_weight(), None) if prepack else None
        return self

    def _head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def kv_shape(self, page_size: int, dtype: str | None = None) -> KVShape:
        """Shape of this model's paged KV cache (K/V dtype defaults to the model dtype)."""
        s = self.spec
        return KVShape(
            s.num_layers, s.num_kv_heads, s.head_dim, page_size, dtype or self.dtype_name
        )

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (prepacked where it was built): [rows, hidden] -> fp32
        [rows, vocab]."""
        return head_logits(self.model.norm, self._head_weight(), self.head_packed, x)

    forward = ModelPart.__call__  # nn.Module's call runs it: the one forward signature

    @torch.inference_mode()  # cheaper than no_grad per op; outputs are read, never updated
    def run(self, a: ForwardArgs) -> torch.Tensor:
        """Logits fp32: [T, vocab], or [num_seqs, vocab] of each sequence's last token.
        `hidden_out` gets the last layer's output [T, hidden] (before the final norm)."""
        if getattr(a.kv, "n_shards", 1) != 1:
            raise ValueError("kv: a sharded (context-parallel) pool needs the dist gather path")
        f = LayerRun.start(a.batch, a.kv, self.model.embed_tokens.weight.device)
        x = self.model.embed_tokens(f.ids)  # [T, hidden]
        prune = a.last_only and a.hidden_out is None
        x = f.run(self.model.layers, x, a.kv, self.rotary, a.before_layer, prune)
        if a.hidden_out is not None:
            a.hidden_out.append(x)  # an MTP draft head's input
        return self.head(f.last_rows(x) if a.last_only else x)  # [T or num_seqs, vocab]


def head_logits(
    norm: nn.Module, weight: torch.Tensor, packed: Prepacked | None, x: torch.Tensor
) -> torch.Tensor:
    """Final norm and LM head `weight` [vocab, hidden] (prepacked where `packed` holds it):
    [rows, hidden] -> fp32 [rows, vocab]."""
    x = norm(x)
    if packed is not None and packed.holds(weight, None):
        return packed(x).float()
    return small_matmul.linear(x, weight, None).float()  # few rows: the native kernel


@dataclass
class LayerRun:
    """One forward's walk through a run of layers (the whole model, or a pipeline stage's)."""

    ids: torch.Tensor  # [T] token ids on the model's device
    positions: torch.Tensor  # [T]
    meta: AttnMeta
    ends: torch.Tensor  # [num_seqs] each sequence's last row
    pruned: bool = False  # only the `ends` rows left the last layer

    @staticmethod
    def start(batch: SeqBatch, kv: KVPool, device: torch.device) -> LayerRun:
        capacity, page_size = kv.k(0).shape[:2]
        batch.validate(page_size, capacity)
        ids, positions = batch.input_ids.to(device), batch.positions.to(device)
        meta = build_meta(positions, batch.seq_lens, batch.ctx_lens, batch.page_tables, page_size)
        ends = torch.tensor(batch.seq_lens, device=device).cumsum(0) - 1
        return LayerRun(ids, positions, meta, ends)

    def run(
        self,
        layers: Sequence[DecoderLayer],
        x: torch.Tensor,  # [T, hidden]
        kv: KVPool,
        rotary: Rotary,
        before_layer: Callable[[int], None] | None,
        prune: bool,
    ) -> torch.Tensor:
        """Each layer over its pool layer (index local to this run). `prune`: only the last
        rows' states leave the last layer: it writes every row's K/V, then runs attention and
        the MLP for those rows alone (one layer's work fewer per prompt token)."""
        rope = rotary.tables(self.positions, x.dtype)
        last = len(layers) - 1
        # a decode step (one row per sequence) has no rows to drop: the last layer runs as any
        self.pruned = prune and all(self.meta.tail) and last >= 0 and x.shape[0] > len(self.ends)
        for i, layer in enumerate(layers):
            if before_layer is not None:
                before_layer(i)  # e.g. wait until layer i's pages arrived from the host pool
            rows = self.ends if self.pruned and i == last else None
            x = layer(x, rope, kv.k(i), kv.v(i), self.meta, rows)
        return x

    def last_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each sequence's last row  # [num_seqs, hidden]"""
        return x if self.pruned or x.shape[0] == len(self.ends) else x[self.ends]  # one each

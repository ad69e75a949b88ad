"""Paged attention over the device pool: write this forward's K/V, read each sequence's context.

The pool stores K and V per layer as [capacity, page_size, kv_heads, head_dim]; a sequence's
logical page i lives in device page page_tables[s][i], token at absolute position p sits in
slot p % page_size of logical page p // page_size.

Each sequence takes the cheapest exact route (all are the same softmax, fp32 equal to float
tolerance; see `PagedAttention._attend`):
- first chunk (nothing cached before it): a causal kernel over the chunk's own K/V; the pool is
  only written, never read back;
- every sequence of the forward a few new tokens at its end (a decode step, a verify's rows;
  CPU): one native kernel over the whole batch reads each sequence's pages where they are,
  once for all its rows (paged_decode.py); the fused q|k|v projection's rotation and the
  K/V write before it are one native pass too (step_ops.rope_write: ~6 of torch's ops and one
  copy per sequence a layer);
- one new token (decode): every key visible, so no mask; pages at consecutive ids are read in
  place, one slice of the pool per run of them (if the runs are few and long: page_runs; one
  kernel each, merged by log-sum-exp on CPU); more fragmented contexts are gathered whole
  (one index_select of page blocks, not one index per token);
- a chunk continuing a cached prefix: attention over the prefix's pages (no mask; runs read in
  place as above, else gathered in blocks of PREFIX_BLOCK_TOKENS) and a causal kernel over the
  chunk's own K/V, merged by their log-sum-exps (CPU); elsewhere one kernel with a lower-right
  causal mask;
- positions that are not the sequence's last tokens (hand-built batches): the general masked
  path over the whole context.
On CPU in fp32 at one torch thread, a chunk of more than one token at the sequence's end (the
first-chunk and prefix routes) runs instead by oneDNN matmuls over its whole context
(dense_attention.py: faster than the flash kernel's sgemm on this project's AMD CPU), its keys
read in place from one run of pages, else gathered; `dense_prefill = False` keeps the routes
above.
K/V heads are never repeated: the kernels take grouped heads (GQA) as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvstrata.model import dense_attention, small_matmul, step_ops
from kvstrata.model.attn_meta import AttnMeta, write_rows
from kvstrata.model.layers import Fused, apply_rotary
from kvstrata.model.paged_decode import paged_decode, shares_rows, usable
from kvstrata.model.prepack import PackOwner, pack_linear, plain_linear

sdpa = nn.functional.scaled_dot_product_attention
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns (out, lse); CPU
PREFIX_BLOCK_TOKENS = 65536  # most prefix tokens one split-prefix gather copies at a time
DENSE_WAYS = ("first_chunk", "split_prefix", "masked_prefix")  # the routes dense_prefill replaces


def merge_by_lse(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Softmax attention over two disjoint key sets from each part's output and log-sum-exp.

    o* [1, heads, n, dim], lse* [1, heads, n]: weight of part 1 = e^lse1 / (e^lse1 + e^lse2).
    """
    w1 = torch.sigmoid(lse1 - lse2)[..., None]  # [1, heads, n, 1] fp32
    if o1.dtype == torch.float32:
        return o2 + (o1 - o2) * w1
    return (o2.float() + (o1.float() - o2.float()) * w1).to(o1.dtype)  # merged in fp32


def route(meta: AttnMeta, s: int, split_prefix: bool) -> str:
    """Which exact kernel sequence s of this forward takes (see the module docstring)."""
    n, ctx = meta.seq_lens[s], meta.ctx_lens[s]
    if not meta.tail[s]:
        return "general"
    if n == ctx:
        return "first_chunk"
    if n == 1:
        return "decode"
    return "split_prefix" if split_prefix else "masked_prefix"


class PagedAttention(PackOwner):
    """Multi-head attention with grouped K/V heads (GQA) reading and writing a paged pool."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.gqa = heads != kv_heads
        self.split_prefix = True  # CPU: see route(); False forces the masked prefix kernel
        self.native_decode = True  # CPU: batched decode by paged_decode; False: per sequence
        self.dense_prefill = True  # CPU fp32: chunks by dense_attention; False: the routes above
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias, dtype=dtype)
        self.fused: Fused | None = None  # q, k, v in one matmul, once fuse() ran

    def fuse(self, prepack: bool = False) -> None:
        """q_proj, k_proj and v_proj as one matmul (see Fused); `prepack`: oneDNN layouts too
        (the plain weights released)."""
        self.unpack()
        self.fused = Fused.build([self.q_proj, self.k_proj, self.v_proj], prepack)
        if prepack:
            self.o_proj = pack_linear(self.o_proj)

    def dense_weights(self) -> dict[str, torch.Tensor]:
        return {} if self.fused is None else self.fused.dense_parts(("q_proj", "k_proj", "v_proj"))

    def unpack(self) -> None:
        if self.fused is not None:
            self.fused.unpack([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj = plain_linear(self.o_proj)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [T, heads, dim], rotated keys and values [T, kv_heads, dim] of x."""
        t, h, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if self.fused is not None and self.fused.holds(parts):
            y = self.fused(x).view(t, h + 2 * kv, d)  # heads: q ... | k ... | v ...
            qk = apply_rotary(y[:, : h + kv], cos, sin)  # one rotation for q and k together
            return qk[:, :h], qk[:, h:], y[:, h + kv :]
        if self.fused is not None:  # a part was replaced: the others' plain weights back
            self.fused.unpack(parts)
        q, k, v = (small_matmul.run(p, x) for p in parts)
        q = apply_rotary(q.view(t, h, d), cos, sin)
        return q, apply_rotary(k.view(t, kv, d), cos, sin), v.view(t, kv, d)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        k_pool: torch.Tensor,  # [capacity, page_size, kv_heads, head_dim] (a view into the pool)
        v_pool: torch.Tensor,
        meta: AttnMeta,
        rows: torch.Tensor | None = None,  # [num_seqs] each sequence's last row, or None (all)
    ) -> torch.Tensor:  # [T or num_seqs, hidden]
        # .view (not reshape) so a non-contiguous pool fails loudly instead of writing a copy.
        k_flat = k_pool.view(-1, self.kv_heads, self.head_dim)  # [capacity * page, kv_heads, dim]
        v_flat = v_pool.view(-1, self.kv_heads, self.head_dim)
        if rows is None and self._one_pass(x, cos, sin, k_flat, v_flat, meta):
            qkv = self.fused(x).view(x.shape[0], -1, self.head_dim)  # [T, h + 2 kv, dim]
            q = step_ops.rope_write(qkv, cos, sin, self.heads, k_flat, v_flat, meta.slots)
            return self._decode(q, k_pool, v_pool, meta)
        q, k, v = self.qkv(x, cos, sin)  # [T, heads | kv_heads, dim] (views, not contiguous)
        write_rows(k_flat, k, meta)  # every row's K/V is cached, whichever rows go on
        write_rows(v_flat, v, meta)
        if rows is not None:  # only these queries: each reads its whole context from the pool
            q, k, v, meta = q[rows], k[rows], v[rows], meta.last_rows(rows)
        t = q.shape[0]
        if self._decodes(q, k_pool, v_pool, meta):
            return self._decode(q, k_pool, v_pool, meta)
        if k_flat.dtype != q.dtype:  # attend to the K/V as stored, as a cached read would
            k, v = k.to(k_flat.dtype).to(q.dtype), v.to(v_flat.dtype).to(q.dtype)
        if len(meta.seq_lens) == 1:  # one sequence: no per-sequence slicing or copy back
            out = self._attend(q, k, v, k_pool, v_pool, meta, 0)  # [1, heads, T, dim]
            out = out[0].transpose(0, 1).reshape(t, self.heads * self.head_dim)
            return small_matmul.run(self.o_proj, out)
        out = torch.empty_like(q)  # [T, heads, head_dim]
        start = 0
        for s, n in enumerate(meta.seq_lens):
            rows = slice(start, start + n)
            o = self._attend(q[rows], k[rows], v[rows], k_pool, v_pool, meta, s)
            out[rows] = o[0].transpose(0, 1)
            start += n
        return small_matmul.run(self.o_proj, out.view(t, self.heads * self.head_dim))

    def _decodes(
        self, x: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMeta
    ) -> bool:
        """True where this forward's rows take the batched decode kernel (paged_decode)."""
        return self.native_decode and meta.rows_as_decode and usable(x, k_pool, v_pool)

    def _one_pass(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        meta: AttnMeta,
    ) -> bool:
        """True where a decode forward's q|k|v go through step_ops.rope_write (rotation and the
        K/V write in one native pass): the batched decode route, the fused matmul still held,
        every tensor fits, the slots inside the pool."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        return (
            self._decodes(x, k_flat, v_flat, meta)
            and self.fused is not None
            and self.fused.holds(parts)
            and x.dtype == cos.dtype == sin.dtype
            and step_ops.fits(x, cos, sin, k_flat, v_flat, meta.slots)
            and meta.slots_within(k_flat.shape[0])
        )

    def _decode(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMeta
    ) -> torch.Tensor:  # [T, hidden]
        """Every row a query over the pages in place (paged_decode: a sequence's rows share one
        read), then o_proj (q [T, heads, dim], its K/V already in the pool)."""
        d = meta.decode_rows  # one kernel, pages read in place
        if d.rows > 1 and not shares_rows(self.heads // self.kv_heads, d.rows, self.head_dim):
            flat, starts, ctx = meta.decode_tables  # each row its own one-row sequence
            out = paged_decode(q, k_pool, v_pool, (flat, starts), ctx)  # [T, heads, dim]
        else:  # a sequence's R rows share one read of its pages
            rows = q if d.pad is None else q[d.pad]  # [S * R, heads, dim]
            out = paged_decode(rows, k_pool, v_pool, (d.flat, d.starts), d.ctx, rows=d.rows)
            out = out if d.keep is None else out[d.keep]  # [T, heads, dim]
        return small_matmul.run(self.o_proj, out.view(q.shape[0], self.heads * self.head_dim))

    def _attend(
        self,
        q: torch.Tensor,  # [n, heads, dim] this sequence's new queries
        k: torch.Tensor,  # [n, kv_heads, dim] their keys (already written to the pool)
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttnMeta,
        s: int,
    ) -> torch.Tensor:
        """Attention output of sequence s  # [1, heads, n, dim]"""
        n, ctx = meta.seq_lens[s], meta.ctx_lens[s]
        qs = q.transpose(0, 1)[None]  # [1, heads, n, dim]
        cpu = q.device.type == "cpu"
        way = route(meta, s, self.split_prefix and cpu)
        if way in DENSE_WAYS and self.dense_prefill and dense_attention.usable(q, ctx):
            if way != "first_chunk":  # the chunk's own K/V are in the pool already
                k, v = self._context(k_pool, v_pool, meta, s, ctx)
            out = dense_attention.chunk_attention(q, k, v, self.head_dim**-0.5)
            return out.transpose(0, 1)[None]  # [1, heads, n, dim] (a view)
        if way == "first_chunk":  # nothing cached before: causal over the chunk, no pool reads
            return sdpa(qs, _bhsd(k), _bhsd(v), is_causal=True, enable_gqa=self.gqa)
        if way == "split_prefix":
            return self._split_prefix(qs, k, v, k_pool, v_pool, meta, s)
        if way == "decode":  # one new token: every key is visible
            pieces = self._in_place(k_pool, v_pool, meta, s, ctx, q.dtype)
            if len(pieces) == 1:
                return sdpa(qs, *pieces[0], enable_gqa=self.gqa)
            if pieces and cpu:  # one kernel per run of pages, merged by log-sum-exp
                return _merged(qs, pieces)[0]
        ks, vs = self._gather(k_pool, v_pool, meta, s, ctx, q.dtype)
        if way == "decode":
            return sdpa(qs, ks, vs, enable_gqa=self.gqa)
        if way == "masked_prefix":  # lower-right causal mask over prefix + chunk
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
        else:
            mask = meta.masks[s]
        return sdpa(qs, ks, vs, attn_mask=mask, enable_gqa=self.gqa)

    def _split_prefix(
        self,
        qs: torch.Tensor,  # [1, heads, n, dim]
        k: torch.Tensor,  # [n, kv_heads, dim] the chunk's own keys
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttnMeta,
        s: int,
    ) -> torch.Tensor:
        """The chunk's own K/V (causal) and the cached prefix (no mask), merged by log-sum-exp.

        The prefix is read in place, one piece per run of consecutive pages; a fragmented one
        is gathered PREFIX_BLOCK_TOKENS at a time, each block merged into the running output,
        so one forward's transient K/V copy stays a block, not the whole prefix (at 1M tokens a
        layer's prefix K/V is GBs).
        """
        o, lse = _FLASH(qs, _bhsd(k), _bhsd(v), is_causal=True)
        prefix = meta.ctx_lens[s] - meta.seq_lens[s]
        pieces: Iterable[tuple[torch.Tensor, torch.Tensor]]
        pieces = self._in_place(k_pool, v_pool, meta, s, prefix, qs.dtype)
        if not pieces:
            pieces = self._blocks(k_pool, v_pool, meta, s, prefix, qs.dtype)
        return _merged(qs, pieces, o, lse)[0]

    def _context(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMeta, s: int, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..ctx-1 of sequence s  # 2 x [ctx, kv_heads, dim]
        (views of the pool where its pages are one run, else gathered; in the pool's dtype)."""
        pieces = self._in_place(k_pool, v_pool, meta, s, ctx, k_pool.dtype)
        if len(pieces) == 1 and pieces[0][0].shape[2] == ctx:  # one run holds the context
            k, v = pieces[0]
            return k[0].transpose(0, 1), v[0].transpose(0, 1)
        ks, vs = self._gather(k_pool, v_pool, meta, s, ctx, k_pool.dtype)
        return ks[0].transpose(0, 1), vs[0].transpose(0, 1)

    def _in_place(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttnMeta,
        s: int,
        length: int,
        dtype: torch.dtype,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of positions 0..length-1 of sequence s as views of the pool, one per run of
        consecutive pages, in order  # [(k, v) each [1, kv_heads, len_i, dim]]
        (empty when the sequence's pages are too fragmented: see page_runs)."""
        runs = meta.runs[s] if meta.runs else None
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        pos, page = 0, meta.page_size
        for first, n in runs or ():
            if pos >= length:
                break
            take = min(n * page, length - pos)
            k, v = (
                _bhsd(pool[first : first + n].view(-1, *pool.shape[2:])[:take].to(dtype))
                for pool in (k_pool, v_pool)
            )
            out.append((k, v))
            pos += take
        return out

    def _blocks(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttnMeta,
        s: int,
        length: int,
        dtype: torch.dtype,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of positions 0..length-1 gathered PREFIX_BLOCK_TOKENS at a time (lazily)."""
        step = max(1, PREFIX_BLOCK_TOKENS // meta.page_size) * meta.page_size
        for a in range(0, length, step):
            yield self._gather(k_pool, v_pool, meta, s, min(a + step, length), dtype, first=a)

    def _gather(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttnMeta,
        s: int,
        length: int,
        dtype: torch.dtype,
        first: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions first..length-1 of sequence s (`first` a page start)
        # 2 x [1, kv_heads, length - first, dim]

        Whole pages are gathered (one index_select of [page, kv_heads, dim] blocks), then cut;
        pages that are one run of consecutive ids are one slice of the pool instead (no copy).
        """
        a, b = first // meta.page_size, -(-length // meta.page_size)
        runs = meta.runs[s] if meta.runs else None
        run = runs[0][0] if runs is not None and len(runs) == 1 else None
        pages = meta.page_tables[s][a:b]
        out = []
        for pool in (k_pool, v_pool):
            kv = pool[run + a : run + b] if run is not None else pool.index_select(0, pages)
            kv = kv.view(-1, self.kv_heads, self.head_dim)
            kv = kv[: length - first]
            out.append(_bhsd(kv.to(dtype)))
        return out[0], out[1]


def _merged(
    qs: torch.Tensor,  # [1, heads, n, dim]
    pieces: Iterable[tuple[torch.Tensor, torch.Tensor]],  # K/V [1, kv_heads, len_i, dim] each
    o: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of qs over every piece's keys (all visible), and a running (o, lse)
    over other keys if given, merged by log-sum-exp  # o [1, heads, n, dim], lse [1, heads, n]"""
    for kp, vp in pieces:
        o1, lse1 = _FLASH(qs, kp, vp)
        if o is None or lse is None:
            o, lse = o1, lse1
        else:
            o, lse = merge_by_lse(o1, lse1, o, lse), torch.logaddexp(lse1, lse)
    assert o is not None and lse is not None, "no keys to attend to"
    return o, lse


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[len, heads, dim] -> [1, heads, len, dim] (a view)."""
    return x.transpose(0, 1)[None]

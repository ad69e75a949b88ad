"""Workload traces: requests, the Mooncake jsonl reader, and hash-id -> token-id mapping.

A Mooncake trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
[...]}` with one hash id per 512-token block of the prompt (the last block is usually partial).
Equal ids in equal positions mean a shared prefix. Each hash id maps to a deterministic block of
512 token ids, so the real page keys, tree and tiers run over it.

Generated workloads (kvstrata/workloads/generated.py) carry explicit token segments instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from kvstrata.cache.keys import Namespace, page_keys

MOONCAKE_BLOCK = 512
"""Tokens per Mooncake hash id."""

DEFAULT_VOCAB = 49152
"""SmolLM2's vocabulary size, so mapped prompts are valid input for the reference engine."""

DEFAULT_MAX_INPUT_TOKENS = 1 << 22
"""Longest prompt a trace line may claim by default (4M tokens; 1M-token prompts are real)."""

_U64 = np.uint64
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TraceRequest:
    """One prompt arriving at `arrival_s`; either hash-id blocks or explicit token segments."""

    rid: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None
    segments: tuple[np.ndarray, ...] | None = field(default=None, compare=False)
    """Prompt tokens = concat(segments); int32 arrays shared between turns of a session."""
    output: np.ndarray | None = field(default=None, compare=False)
    """Output token ids, cached after the request (the next turn's prompt starts with them)."""

    def __post_init__(self) -> None:
        if (self.hash_ids is None) == (self.segments is None):
            raise ValueError("TraceRequest needs exactly one of hash_ids or segments")
        if self.input_length <= 0:
            raise ValueError(f"input_length must be > 0, got {self.input_length}")


@dataclass
class Trace:
    """Requests sorted by arrival, plus the problems found while reading (skip mode)."""

    requests: list[TraceRequest]
    source: str = ""
    errors: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


class TraceError(ValueError):
    """A malformed trace; the message names the file and line numbers."""


def _check_line(
    obj: object, max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS
) -> tuple[float, int, int, tuple[int, ...]]:
    """Validate one decoded line; raise ValueError saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [
        k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj
    ]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    ts, n_in, n_out, ids = (
        obj["timestamp"],
        obj["input_length"],
        obj["output_length"],
        obj["hash_ids"],
    )
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a number >= 0, got {ts!r}")
    for name, v, lo in (("input_length", n_in, 1), ("output_length", n_out, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if n_in > max_input_tokens:
        raise ValueError(
            f"input_length {n_in:,} exceeds the limit of {max_input_tokens:,} tokens "
            "(--max-input-tokens)"
        )
    if not isinstance(ids, list) or not all(type(x) is int and x >= 0 for x in ids):
        raise ValueError("hash_ids must be a list of integers >= 0")
    want = -(-n_in // MOONCAKE_BLOCK)
    if len(ids) != want:
        raise ValueError(
            f"input_length {n_in} needs {want} hash_ids of {MOONCAKE_BLOCK} tokens, got {len(ids)}"
        )
    return float(ts), n_in, n_out, tuple(ids)


Row = tuple[float, int, int, tuple[int, ...]]


def _read_rows(
    path: Path, max_requests: int | None, max_input_tokens: int
) -> tuple[list[Row], list[str]]:
    """Valid rows and `file:line: reason` for every malformed line."""
    rows: list[Row] = []
    errors: list[str] = []
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(_check_line(json.loads(line), max_input_tokens))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                errors.append(f"{path}:{lineno}: {exc}")
            if max_requests is not None and len(rows) >= max_requests:
                break
    return rows, errors


def _malformed(errors: list[str]) -> str:
    """Strict mode's refusal: the bad line, or the first 20 of them."""
    if len(errors) == 1:
        return f"{errors[0]} (use skip mode to drop it)"
    shown = "\n  ".join(errors[:20]) + (
        f"\n  ... {len(errors) - 20} more" if len(errors) > 20 else ""
    )
    return f"{len(errors)} malformed line(s) (use skip mode to drop them):\n  {shown}"


def read_mooncake(
    path: str | Path,
    on_error: str = "strict",
    max_requests: int | None = None,
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
) -> Trace:
    """Read a Mooncake jsonl trace, sorted by timestamp (stable).

    on_error="strict" refuses the file when any line is malformed (every bad line is listed);
    "skip" drops those lines and lists them in `Trace.errors`. An empty result is an error either
    way: a trace with no requests would silently report a zero hit rate.
    """
    if on_error not in ("strict", "skip"):
        raise ValueError(f"on_error must be 'strict' or 'skip', got {on_error!r}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    rows, errors = _read_rows(path, max_requests, max_input_tokens)
    if errors and on_error == "strict":
        raise TraceError(_malformed(errors))
    if not rows:
        raise TraceError(
            f"{path}: no valid requests" + (f" ({len(errors)} malformed lines)" if errors else "")
        )
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    reqs = [
        TraceRequest(
            rid=k,
            arrival_s=rows[i][0] / 1000.0,
            input_length=rows[i][1],
            output_length=rows[i][2],
            hash_ids=rows[i][3],
        )
        for k, i in enumerate(order)
    ]
    return Trace(reqs, source=str(path), errors=errors)


def write_mooncake(requests: Sequence[TraceRequest], path: str | Path) -> None:
    """Write hash-id requests back as Mooncake jsonl (timestamps in ms)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            if r.hash_ids is None:
                raise ValueError(
                    f"request {r.rid} has no hash_ids; only Mooncake-style requests can be written"
                )
            row = {"timestamp": round(r.arrival_s * 1000.0), "input_length": r.input_length}
            row |= {"output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            f.write(json.dumps(row) + "\n")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser (uint64 in, uint64 out): a fixed, platform-free mixer."""
    with np.errstate(over="ignore"):
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


class TokenMapper:
    """Deterministic hash id -> `block` token ids (same on every machine and run)."""

    def __init__(
        self, vocab_size: int = DEFAULT_VOCAB, block: int = MOONCAKE_BLOCK, seed: int = 0
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if block <= 0:
            raise ValueError(f"block must be > 0, got {block}")
        self.vocab_size, self.block, self.seed = vocab_size, block, seed
        self._offsets = np.arange(block, dtype=np.uint64)

    def block_tokens(self, hash_id: int) -> np.ndarray:
        """[block] int32 token ids of one hash id.

        The stream of a hash id is seeded by xxh3-128 of the whole id (any size, as decimal
        text): no arithmetic wrap-around, so ids 2^55 or 2^64 apart get unrelated blocks (the
        old `id * block mod 2^64` aliased every pair of ids 2^55 apart)."""
        digest = xxhash.xxh3_128_intdigest(str(hash_id).encode(), seed=self.seed & _MASK64)
        lo, hi = _U64(digest & _MASK64), _U64(digest >> 64)
        with np.errstate(over="ignore"):
            mixed = _splitmix64(_splitmix64(self._offsets ^ lo) + hi)
        return (mixed % _U64(self.vocab_size)).astype(np.int32)

    def prompt_tokens(self, req: TraceRequest) -> np.ndarray:
        """[input_length] int32 prompt token ids of a request."""
        if req.segments is not None:
            toks = np.concatenate(req.segments) if len(req.segments) > 1 else req.segments[0]
            return np.ascontiguousarray(toks[: req.input_length], dtype=np.int32)
        assert req.hash_ids is not None
        toks = np.concatenate([self.block_tokens(h) for h in req.hash_ids])
        return toks[: req.input_length]


class KeyMapper:
    """Page keys of requests, memoised per (parent key, hash id) so full traces hash each block once.

    The memo is exact: a block's page keys depend only on the key before it and its tokens, and a
    hash id always maps to the same tokens. A partial last block's full pages are a prefix of the
    same block's full pages, so they reuse the memo too.
    """

    def __init__(self, namespace: Namespace, mapper: TokenMapper) -> None:
        if mapper.block % namespace.page_size:
            raise ValueError(
                f"page_size {namespace.page_size} must divide the trace block size {mapper.block}"
            )
        self.ns, self.mapper = namespace, mapper
        self._root = namespace.seed()
        self._memo: dict[tuple[int, int], list[int]] = {}

    def keys(self, req: TraceRequest, n_tokens: int | None = None) -> list[int]:
        """Keys of the full pages in the first `n_tokens` (default all) prompt tokens."""
        n = req.input_length if n_tokens is None else min(n_tokens, req.input_length)
        page = self.ns.page_size
        if req.hash_ids is None:
            return page_keys(self.mapper.prompt_tokens(req)[:n], self.ns)
        out: list[int] = []
        parent: int | None = None
        per_block = self.mapper.block // page
        for h in req.hash_ids:
            want = min(per_block, n // page - len(out))
            if want <= 0:
                break
            memo_key = (self._root if parent is None else parent, h)
            block_keys = self._memo.get(memo_key)
            if block_keys is None:
                block_keys = page_keys(self.mapper.block_tokens(h), self.ns, parent_key=parent)
                self._memo[memo_key] = block_keys
            out.extend(block_keys[:want])
            parent = block_keys[-1]
        return out

    def output_keys(self, req: TraceRequest, prompt_keys: list[int]) -> list[int]:
        """Keys of the full pages of prompt + output (what a finished request leaves cached)."""
        if req.output is None or req.segments is None:
            return prompt_keys
        page = self.ns.page_size
        if len(prompt_keys) != req.input_length // page:
            raise ValueError("output_keys needs the keys of the whole prompt")
        done = len(prompt_keys) * page  # continue the chain after the prompt's last full page
        tail = np.concatenate([self.mapper.prompt_tokens(req)[done:], req.output])
        parent = prompt_keys[-1] if prompt_keys else None
        return prompt_keys + page_keys(tail, self.ns, parent_key=parent)

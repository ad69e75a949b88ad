"""Per-request sampling: greedy, or temperature / top-p from a generator seeded per request.

Every rank holds the same logits row and a generator seeded from the same request seed, so every
rank draws the same token without exchanging it. Greedy (temperature 0) is `argmax`, exactly what
the engine did before sampling existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import xxhash

from kvstrata.model import step_ops


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token, and which tokens end it."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # None: derived from the request id (still equal on every rank)
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    """One request's sampling state: its params and its own torch.Generator."""

    def __init__(self, params: SamplingParams, rid: str) -> None:
        self.params = params
        seed = params.seed
        if seed is None:  # never Python's hash(): equal across processes
            seed = xxhash.xxh3_64_intdigest(rid.encode())
        self.generator = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
        self.failed: str | None = None  # why this request cannot be sampled (it stops)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def sample(self, row: torch.Tensor) -> int:
        """The next token from one logits row [vocab]."""
        if self.greedy:
            return step_ops.argmax(row)
        return self.draw(self.probs(row))

    def probs(self, row: torch.Tensor) -> torch.Tensor:
        """The distribution a token is drawn from: softmax(row / T), cut to top_p [vocab] fp32.
        Speculative sampling applies it to the draft's and the target's rows alike.

        Stable for every temperature > 0: where row / T overflows fp32 (T far below 1, e.g.
        1e-300, which fp32 even rounds to 0) the scaled row is taken in fp64 with its maximum
        subtracted first, so the distribution tends to argmax (ties shared) instead of NaN."""
        p = self.params
        assert p.temperature > 0, "greedy requests take argmax, not a distribution"
        scaled = row.float() / p.temperature  # [vocab]
        if not bool(torch.isfinite(scaled).all()):
            wide = row.double()
            scaled = (wide - wide.max()) / p.temperature  # <= 0, the maximum exactly 0
        probs = torch.softmax(scaled, dim=-1).float()  # [vocab]
        return _top_p(probs, p.top_p) if p.top_p < 1 else probs

    def draw(self, probs: torch.Tensor) -> int:
        """One token from `probs` [vocab] (need not sum to 1), from this request's generator.

        A distribution that cannot be sampled (NaN/inf from non-finite logits) must not raise
        inside the step, which would fail the whole batch: this request is marked failed, gets
        the most likely finite entry, and stops (see stops()); its batch mates go on."""
        total = float(probs.sum())
        if not (math.isfinite(total) and total > 0) or bool((probs < 0).any()):
            self.failed = f"cannot sample: the distribution sums to {total}"
            return int(torch.argmax(torch.nan_to_num(probs, nan=-1.0, posinf=-1.0)))
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        """One number in [0, 1) from this request's generator (the rejection test's coin)."""
        return float(torch.rand(1, generator=self.generator))

    def stops(self, token: int) -> bool:
        return self.failed is not None or token in self.params.stop_token_ids


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the first always)."""
    sorted_p, order = torch.sort(probs, descending=True)  # [vocab] each
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
    keep = before < top_p  # a top_p below fp32's range (1e-300) would keep nothing:
    keep[0] = True  # the most likely token always stays
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return kept / kept.sum()

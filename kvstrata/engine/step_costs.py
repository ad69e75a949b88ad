"""What a step costs, learnt online from the steps that ran: the scheduler's decode-latency target
(`EngineConfig.tpot_target_ms`) gives prefill only the step time its decodes leave under the target.

Model: a step of n decodes and p prefill tokens takes `decode_s + p * prefill_token_s`, where
`decode_s` is the time of a step of decodes alone (the batch's weights and KV read once; it varies
little with n on a CPU, so it is one figure) and `prefill_token_s` the time per prefill token.
Each is an exponential average of its own samples: an all-decode step samples `decode_s`; a step
with prefill samples `prefill_token_s` as (its time - the decodes' share) / p. Durations come from
the scheduler's clock (the agreed one under several ranks), so every rank learns the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.5
"""Weight of a new sample in each average (the rest stays with the estimate)."""


@dataclass
class StepCosts:
    """Online estimates of a step's decode cost and per-prefill-token cost, in seconds."""

    decode_s: float | None = None
    """Time of a step of decodes alone; None until such a step ran."""
    prefill_token_s: float | None = None
    """Time per prefill token beyond the decodes' share; None until a step carried prefill."""

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """One step that ran `decodes` decode rows and `prefill_tokens` prompt tokens."""
        if prefill_tokens == 0:
            if decodes:
                self.decode_s = _blend(self.decode_s, seconds)
            return
        decode_share = (self.decode_s or 0.0) if decodes else 0.0
        per_token = max(seconds - decode_share, 0.0) / prefill_tokens
        self.prefill_token_s = _blend(self.prefill_token_s, per_token)

    def prefill_room(self, target_s: float, floor: int) -> int | None:
        """Prefill tokens that keep a step with decodes under `target_s` (at least `floor`, so
        prompts always progress); None while no prefill cost is known (no cap from the target)."""
        if not self.prefill_token_s:  # unknown, or too small to measure
            return None
        slack = target_s - (self.decode_s or 0.0)
        return max(floor, int(slack / self.prefill_token_s))


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)

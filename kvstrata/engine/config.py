"""Configuration of the reference engine."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.configtools import doc, require_positive


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and model options."""

    model: str = doc(
        "", "local Hugging Face Llama/Qwen2 checkpoint dir; empty = SmolLM2-135M-Instruct"
    )
    model_cache_dir: str = doc(
        "", "where the converted SmolLM2 checkpoint lives; empty = ~/.cache/kvstrata"
    )
    dtype: str = doc("float32", "model and KV dtype")
    # 0: the first waiting prefill takes all the step's budget has left, the next one the rest
    # (vLLM's scheduler does the same, with the same 2048-token budget on CPU). Attention over a
    # 4k prompt costs the same in chunks of 1024, 2048 or one shot, but a cap of 1024 split each
    # step between two prompts, so both finished late: `kvstrata bench serve --url` (8 agent
    # sessions, 4 at once, 1 thread) TTFT p50 8.43 s with 1024, 6.01 s uncapped.
    chunk_tokens: int = doc(
        0, "prefill chunk cap: new tokens per sequence per forward (0 = the step's budget)"
    )
    max_batch_tokens: int = doc(2048, "new tokens per forward across the batch")
    prefill_order: str = doc(
        "arrival",
        "which running prompt the step's prefill budget goes to first: arrival (admission "
        "order) or shortest (fewest tokens left; a prompt passed over in a step goes first in "
        "the next)",
    )
    # A step's time grows with its prefill tokens, and every decoding request waits for the
    # step: this budget bounds the steps that carry decodes (vLLM's chunked-prefill budget,
    # decodes first), trading the waiting prompts' TTFT for the running requests' TPOT.
    decode_step_tokens: int = doc(
        0,
        "decode-latency budget: new tokens per forward while any request decodes (every decode "
        "first, prefill chunks fill the rest); 0 = max_batch_tokens",
    )
    # A fixed budget bounds a step's tokens, not its time: a prefill token costs far more than a
    # decode row, and the cost moves with the machine's load. The target is in time: the
    # scheduler learns a step's decode cost and per-prefill-token cost from the steps that ran
    # (kvstrata.engine.step_costs) and gives prefill only the time its decodes leave.
    tpot_target_ms: float = doc(
        0.0,
        "decode-latency target: while requests decode, a step carries prefill only up to this "
        "time (learnt step costs) and at least tpot_min_prefill_tokens; 0 = off",
    )
    tpot_min_prefill_tokens: int = doc(
        32, "prefill tokens a step with decodes always may carry under tpot_target_ms"
    )
    max_running: int = doc(8, "requests decoding at once")
    admission_lookahead: int = doc(
        4, "waiting requests whose leases match, probe and prefetch at once (no head-of-line wait)"
    )
    # A storage probe answers in about a millisecond (a local store's existence checks, on a
    # lane of their own), but its answer is applied at a step boundary: asked in admission, it
    # waits out the whole forward that follows (0.2-0.4 s on the agent bench) before its
    # request may be admitted. Asked before the step's agreement, it comes with it.
    probe_wait_ms: float = doc(
        10.0,
        "a step with newly arrived requests waits up to this long for their storage probes, "
        "asked before its agreement, so they may be admitted in it; 0 = no wait",
    )
    threads: int = doc(0, "torch CPU threads; 0 = torch's default")
    prepack_weights: bool = doc(
        True,
        "CPU fp32: linear weights kept in oneDNN's blocked layout instead of the plain one "
        "(faster matmuls; the tied LM head keeps both: SmolLM2's model RSS 619 -> 744 MiB)",
    )
    spec_draft: str = doc(
        "",
        "speculative decoding draft: empty = off, self:K = the target's first K layers + its "
        "norm and head (built once under the model cache dir), a Llama/Qwen2 checkpoint dir, or "
        "mtp:PATH / mtp:random = an MTP (NextN) head: a safetensors file / fixed random weights, "
        "nextn = the checkpoint's NextN layer (DIR/nextn.safetensors; for SmolLM2 one trained "
        "here on first use, cached under the model cache dir)",
    )
    spec_tokens: int = doc(4, "speculative decoding: tokens the draft proposes per step")

    def __post_init__(self) -> None:
        positive = ("max_batch_tokens", "max_running", "admission_lookahead", "spec_tokens")
        require_positive(self, *positive)
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {self.chunk_tokens}")
        if self.chunk_tokens > self.max_batch_tokens:
            raise ValueError("chunk_tokens must be <= max_batch_tokens")
        if not 0 <= self.decode_step_tokens <= self.max_batch_tokens:
            raise ValueError(
                f"decode_step_tokens must be in [0, max_batch_tokens={self.max_batch_tokens}], "
                f"got {self.decode_step_tokens}"
            )
        if self.probe_wait_ms < 0:
            raise ValueError(f"probe_wait_ms must be >= 0, got {self.probe_wait_ms}")
        if self.tpot_target_ms < 0:
            raise ValueError(f"tpot_target_ms must be >= 0, got {self.tpot_target_ms}")
        if not 0 < self.tpot_min_prefill_tokens <= self.max_batch_tokens:
            raise ValueError(
                "tpot_min_prefill_tokens must be in [1, max_batch_tokens="
                f"{self.max_batch_tokens}], got {self.tpot_min_prefill_tokens}"
            )
        if 0 < self.decode_step_tokens <= self.max_running:  # else a prompt could wait for ever
            raise ValueError(
                f"decode_step_tokens must be more than max_running={self.max_running} (room "
                f"for a prefill chunk beside every decode), got {self.decode_step_tokens}"
            )

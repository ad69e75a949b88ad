"""Random Llama checkpoints (config.json + safetensors) with fixed seeds, for benchmarks.

Same seed and options -> identical bytes. The tests' own builders (tests/tiny_models.py) add
Qwen2 and bias variants; this one serves `kvstrata bench` runs that need no download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SMALL: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
"""A model small enough to compute fast on 2 cores, with pages big enough (256 KiB of fp32
KV per 64-token page) that moving them is real work."""


def make_random_llama(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random LlamaForCausalLM with SMALL's shape (plus `overrides`) to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, **overrides}))
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return out

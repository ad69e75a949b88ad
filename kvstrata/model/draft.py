"""Draft models for speculative decoding, and the pool view that gives a draft its own layers.

A draft's KV is packed as extra tail layers of every page (layers [target_layers,
target_layers + draft_layers) of the pool), so a page id names target and draft KV together:
every tier, copy and store moves both with no code of its own, and a page whose draft part is
missing is missing as a whole. That needs the draft's K/V heads, head_dim and dtype to equal the
target's (true for `self:K`); other geometries are refused with a one-line error.

`self:K` = the target's first K layers + its final norm + its head, saved once as a checkpoint of
its own under the model cache dir (so it has its own fingerprint and loads like any draft).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import DecoderLM, ModelSpec

SELF_PREFIX = "self:"


class DraftKV:
    """The draft's layers of a pool: layer i of the draft is layer `offset + i` of the pool.

    Also a DevicePool look-alike over those layers (shape, data, shards), so the context-parallel
    forward (kvstrata.model_parallel.cp.CPModel) runs a draft over them unchanged."""

    def __init__(self, pool: Any, offset: int) -> None:
        self.pool, self.offset = pool, offset
        self.capacity, self.device = pool.capacity, pool.device
        self.n_shards, self.rank = getattr(pool, "n_shards", 1), getattr(pool, "rank", 0)

    @property
    def shape(self) -> Any:  # KVShape of the draft's layers only
        s = self.pool.shape
        return dataclasses.replace(s, num_layers=s.num_layers - self.offset)

    @property
    def data(self) -> torch.Tensor:  # [draft layers, 2, capacity_local, page, kv_heads, head_dim]
        return self.pool.data[self.offset :]

    def k(self, layer: int) -> torch.Tensor:  # [capacity, page_size, kv_heads, head_dim]
        return self.pool.k(self.offset + layer)

    def v(self, layer: int) -> torch.Tensor:
        return self.pool.v(self.offset + layer)


def parse_self_k(spec_draft: str, target_layers: int) -> int:
    """K of `self:K`; ValueError naming spec_draft unless 1 <= K < target layers."""
    text = spec_draft[len(SELF_PREFIX) :]
    if not text.isdigit() or not 1 <= int(text) < target_layers:
        raise ValueError(
            f"spec_draft {spec_draft!r}: self:K needs an integer K in [1, {target_layers})"
        )
    return int(text)


def _hf_config(spec: ModelSpec, layers: int) -> dict[str, Any]:
    """config.json of `spec` cut to `layers` layers (parse_spec reads it back to the same spec)."""
    qwen2 = spec.architecture == "Qwen2ForCausalLM"
    cfg: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.o_bias,
        "mlp_bias": spec.mlp_bias,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
    }
    if spec.rope_scaling is not None:
        cfg["rope_scaling"] = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
    return cfg


def _self_state(target: DecoderLM, k: int) -> dict[str, torch.Tensor]:
    """Embedding, layers [0, k), final norm and head of `target` (contiguous copies)."""
    keep: dict[str, torch.Tensor] = {}
    for name, tensor in target.state_dict().items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= k:
                continue
        keep[name] = tensor.detach().contiguous().clone()
    return keep


def ensure_self_draft(target: DecoderLM, k: int, cache_dir: Path) -> Path:
    """The `self:K` checkpoint of `target`, written once under cache_dir/drafts (atomically)."""
    if not target.fingerprint:
        raise ValueError("spec_draft self:K needs a target loaded from a checkpoint")
    out = Path(cache_dir) / "drafts" / f"{target.fingerprint}-self{k}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(_self_state(target, k), str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(_hf_config(target.spec, k), indent=1))
        os.replace(tmp, out)  # a concurrent builder that won leaves an equal checkpoint
    except OSError:
        if not (out / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_draft(target: DecoderLM, draft: DecoderLM, name: str) -> None:
    """ValueError (naming spec_draft) unless the draft can share the target's pages."""
    t, d = target.spec, draft.spec
    if d.vocab_size != t.vocab_size:
        raise ValueError(f"spec_draft {name}: vocab {d.vocab_size} != target's {t.vocab_size}")
    if (d.num_kv_heads, d.head_dim) != (t.num_kv_heads, t.head_dim):
        raise ValueError(
            f"spec_draft {name}: K/V heads x head_dim {d.num_kv_heads}x{d.head_dim} != target's "
            f"{t.num_kv_heads}x{t.head_dim} (the draft's KV is packed into the target's pages)"
        )
    if draft.dtype_name != target.dtype_name:
        raise ValueError(f"spec_draft {name}: dtype {draft.dtype_name} != {target.dtype_name}")


def load_draft(spec_draft: str, target: DecoderLM, cache_dir: Path) -> DecoderLM:
    """The draft named by `spec_draft` (`self:K` or a checkpoint dir), checked against target."""
    if spec_draft.startswith(SELF_PREFIX):
        k = parse_self_k(spec_draft, target.spec.num_layers)
        path = ensure_self_draft(target, k, cache_dir)
    else:
        path = Path(spec_draft)
        if not (path / "config.json").is_file():
            raise ValueError(f"spec_draft {spec_draft!r}: not self:K nor a checkpoint dir")
    device = target.model.embed_tokens.weight.device
    draft = load_model(path, dtype=target.dtype_name, device=str(device))
    check_draft(target, draft, spec_draft)
    return draft

"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into a DecoderLM.

Also computes the model fingerprint that seeds the cache namespace: pages of KV made by one set of
weights must never be served to another.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors.torch import load_file

from kvstrata.memory.layout import DTYPES
from kvstrata.model.decoder import DecoderLM, ModelSpec
from kvstrata.model.deepseek import MLADecoderLM, parse_deepseek_spec


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face architecture name loads: its model class and its own config."""

    model: type[DecoderLM]
    """The class built from the spec (its state dict names equal the checkpoint's)."""
    refine: Callable[[dict[str, Any], ModelSpec], ModelSpec] = lambda cfg, base: base
    """The architecture's own fields on top of the shared ModelSpec (config dict, base)."""
    fp32_keys: tuple[str, ...] = ()
    """Suffixes of weights kept fp32 whatever the model dtype (e.g. an MoE router's)."""


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(DecoderLM),
    "Qwen2ForCausalLM": Architecture(DecoderLM),
    "DeepseekV3ForCausalLM": Architecture(
        MLADecoderLM,
        parse_deepseek_spec,
        fp32_keys=("mlp.gate.weight", "mlp.gate.e_score_correction_bias"),
    ),
}
"""Supported architectures by config.json name (README lists them)."""
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
INDEX_FILE = "model.safetensors.index.json"
_SAMPLE = 4096  # bytes hashed at the start and the middle of every tensor


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of checkpoint `path` as a dict; ValueError if `path` is not a checkpoint."""
    root = Path(path)
    cfg = root / "config.json"
    if not root.is_dir() or not cfg.is_file():
        raise ValueError(f"{root} is not a Hugging Face checkpoint: missing config.json")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{cfg} must hold a JSON object")
    return data


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or [_MODEL_TYPES.get(str(cfg.get("model_type")), "")]
    arch = archs[0] if len(archs) == 1 else f"{archs}"
    if arch not in SUPPORTED_ARCHITECTURES:
        found = arch or f"model_type {cfg.get('model_type')!r}"
        raise ValueError(
            f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling or None) from either config style: transformers 5's
    `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        params = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported rope: partial_rotary_factor != 1")
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = rope_type
    return theta, scaling


def parse_spec(cfg: dict[str, Any]) -> ModelSpec:
    """ModelSpec from a config.json dict; ValueError for what this engine cannot run."""
    arch = _architecture(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only silu")
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
        raise ValueError("unsupported: sliding-window attention layers")
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    qwen2 = arch == "Qwen2ForCausalLM"
    bias = bool(cfg.get("attention_bias", False))
    base = ModelSpec(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qwen2 or bias,  # Qwen2 always has q/k/v biases, never an o_proj bias
        o_bias=bias and not qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and not qwen2,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
    )
    return ARCHITECTURES[arch].refine(cfg, base)


def weight_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files (via the shard index when there is one), sorted."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / n for n in names]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} is not a Hugging Face checkpoint: no *.safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint {root} lacks shard files: {missing}")
    return files


def _hash_safetensors(h: xxhash.xxh3_128, file: Path) -> None:
    """Fold the header (names, dtypes, shapes, offsets) and samples of every tensor into h."""
    with file.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n)
        h.update(file.name.encode() + b"\0" + header)
        base = 8 + n
        meta = json.loads(header)
        for name in sorted(k for k in meta if k != "__metadata__"):
            start, end = meta[name]["data_offsets"]
            # A fine-tune changes essentially every element of the tensors it touches, so
            # the start and the middle of each tensor identify the weights cheaply.
            for offset in (start, (start + end) // 2):
                f.seek(base + offset)
                h.update(f.read(min(_SAMPLE, end - offset)))


def fingerprint(path: str | Path) -> str:
    """Deterministic 32-hex digest of the checkpoint's weights (equal across processes/hosts)."""
    h = xxhash.xxh3_128()
    h.update((Path(path) / "config.json").read_bytes())
    for file in weight_files(path):
        _hash_safetensors(h, file)
    return h.hexdigest()


def _state_dict(path: Path, spec: ModelSpec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        state.update(load_file(str(file)))
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the head is the embedding matrix
    fp32 = ARCHITECTURES[spec.architecture].fp32_keys
    return {
        k: v.to(torch.float32 if k.endswith(fp32) else dtype)
        for k, v in state.items()
        if not k.endswith("rotary_emb.inv_freq") and not _extra_layer(k, spec.num_layers)
    }


def _extra_layer(key: str, num_layers: int) -> bool:
    """True for weights of layers past the decoder's own (a checkpoint's NextN/MTP layers,
    which a draft reads, never the target)."""
    m = _LAYER_KEY.match(key)
    return m is not None and int(m.group(1)) >= num_layers


def load_model(
    path: str | Path, dtype: str = "float32", device: str = "cpu", prepack: bool = True
) -> DecoderLM:
    """DecoderLM with the checkpoint's weights, in `dtype`, on `device`, in eval mode;
    `prepack`: CPU fp32 linears also in oneDNN's layout (DecoderLM.fuse), their plain weights
    released (model/prepack.py)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    root = Path(path)
    spec = parse_spec(read_config(root))
    with torch.device("meta"):
        model = ARCHITECTURES[spec.architecture].model(spec, dtype)
    state = _state_dict(root, spec, DTYPES[dtype])
    mapped = {t.untyped_storage().data_ptr() for t in state.values()}
    result = model.load_state_dict(state, strict=False, assign=True)
    del state
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {root} does not match {spec.architecture}: "
            f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    model.rotary = model.make_rotary()  # was on meta
    model.fingerprint = fingerprint(root)
    # fused on the device: views of the moved weights
    model = model.to(device).eval().fuse(prepack)
    if prepack and _copy_out(model, mapped):
        model.pack_head()  # its weight moved: packed again from the copy
    return model


def _copy_out(model: DecoderLM, mapped: set[int]) -> bool:
    """Copy the parameters still backed by the checkpoint file into memory of their own; True
    if any was. safetensors maps the whole file, and one tensor left in it keeps every page the
    load touched resident: prepacked, the released linears (most of the file) would stay in
    RSS for the embedding and norms. The Parameter objects stay (in place: `.data`)."""
    moved = False
    for param in model.parameters():
        if param.device.type == "cpu" and param.untyped_storage().data_ptr() in mapped:
            param.data = param.detach().clone()
            moved = True
    return moved

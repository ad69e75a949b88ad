"""Tiny random Hugging Face checkpoints (config.json + safetensors), built with fixed seeds.

Shared by the tests of every layer that needs a real model (`from tests.tiny_models import ...`),
with the reference helpers: transformers' own logits and greedy tokens, computed from scratch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

_COMMON: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: 2 query heads per K/V head
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}


def _save(model: Any, path: Path) -> Path:
    # Random init leaves every bias at zero; make them matter so a dropped bias would show.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return path


def make_llama(
    path: str | Path,
    seed: int = 0,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Save a random LlamaForCausalLM to `path`; same seed and options -> identical bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kw = {**_COMMON, "rope_theta": 5000.0, "tie_word_embeddings": tie, **overrides}
    if rope_scaling is not None:
        kw["rope_scaling"] = {**rope_scaling, "rope_theta": kw["rope_theta"]}
    model = LlamaForCausalLM(LlamaConfig(**kw))
    return _save(model, Path(path))


def make_qwen2(path: str | Path, seed: int = 0, tie: bool = True, **overrides: Any) -> Path:
    """Save a random Qwen2ForCausalLM (q/k/v biases) to `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        **{**_COMMON, "rope_theta": 20000.0, "tie_word_embeddings": tie, **overrides}
    )
    return _save(Qwen2ForCausalLM(config), Path(path))


def load_hf(path: str | Path) -> Any:
    """transformers' own model for `path`, fp32, eval mode: the correctness reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] fp32 logits of one sequence, computed from scratch (no cache)."""
    return hf(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf: Any, tokens: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens, each recomputing the whole sequence (no KV cache involved)."""
    seq = list(tokens)
    for _ in range(steps):
        seq.append(int(hf_logits(hf, seq)[-1].argmax()))
    return seq[len(tokens) :]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return float((ours - ref).abs().max() / ref.abs().max())


def save_echo_head(ckpt: Path, path: Path, vocab: int = 0) -> str:
    """An MTP head (`mtp:random`'s fixed weights) set to echo the target's prediction at the
    previous position, saved at `path`; its --spec-draft. A random head accepts nothing on these
    tiny models, which would make acceptance checks vacuous. `vocab` > 0: the head scores only
    ids 0 .. vocab-1 (a reduced output head)."""
    from safetensors.torch import save_file

    from kvstrata.model.checkpoint import load_model
    from kvstrata.model.mtp import VOCAB_IDS, load_head

    model = load_model(ckpt)
    # edited as a state dict: a loaded head's layer is packed (its plain weights re-derived here)
    state = {k: v.clone() for k, v in load_head("mtp:random", model).state_dict().items()}
    hidden = model.spec.hidden_size
    # eh_proj([enorm(e); hnorm(h)]) = hnorm(h); the layer nearly identity
    state["eh_proj.weight"].zero_()
    state["eh_proj.weight"][:, hidden:] = torch.eye(hidden)
    state["norm.weight"].copy_(model.model.norm.weight)
    state["layer.self_attn.o_proj.weight"].mul_(0.1)
    state["layer.mlp.down_proj.weight"].mul_(0.1)
    if vocab:
        state[VOCAB_IDS] = torch.arange(vocab)
    save_file(state, str(path))
    return f"mtp:{path}"


YARN_SCALING = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

_DEEPSEEK: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,  # the dense layers' MLP
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,  # one dense layer, then two MoE layers
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 10,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "max_position_embeddings": 256,  # = 4 x YARN_SCALING's original
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,
    "num_nextn_predict_layers": 0,
}


def make_deepseek(
    path: str | Path, seed: int = 0, rope_scaling: dict[str, Any] | None = None, **overrides: Any
) -> Path:
    """Save a random DeepseekV3ForCausalLM (MLA, dense then MoE layers) to `path`; same seed and
    options -> identical bytes. The router's correction bias is drawn too (zero by default)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    kw = {**_DEEPSEEK, **overrides}
    if rope_scaling is not None:
        kw["rope_scaling"] = {**rope_scaling, "rope_theta": kw["rope_theta"]}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**kw))
    _draw_router_bias(model)
    _save(model, Path(path))
    if kw["num_nextn_predict_layers"]:
        _add_nextn_layer(Path(path), model, seed)
    return Path(path)


def _draw_router_bias(model: Any) -> None:
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)


def _add_nextn_layer(path: Path, model: Any, seed: int) -> None:
    """Append a NextN layer in DeepSeek-V3's layout (`model.layers.{N}.*`, N =
    num_hidden_layers: enorm, hnorm, eh_proj, an MoE decoder block, shared_head.norm/head, an
    embedding copy) to the checkpoint's weights. The block is layer N of a random model one
    layer deeper (transformers' init), its outputs damped. A random layer accepts nothing on
    these tiny models, so the layer is made a bigram predictor: eh_proj passes the token's
    embedding (plus a share of the target's state), and its own output head (shared_head.head,
    unlike DeepSeek-V3's a copy that differs from lm_head) maps each token t to the target's
    greedy choice after the one-token prompt [t]."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = model.config
    n, hidden, vocab = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    torch.manual_seed(seed + 7919)
    deeper = DeepseekV3ForCausalLM(
        DeepseekV3Config(**{**cfg.to_dict(), "num_hidden_layers": n + 1})
    )
    _draw_router_bias(deeper)
    block = deeper.model.layers[n]
    with torch.no_grad():
        block.self_attn.o_proj.weight.mul_(0.1)
        for name, param in block.mlp.named_parameters():
            if "down_proj" in name:  # routed (fused in memory) and shared experts
                param.mul_(0.1)
        enorm = 1.0 + 0.1 * torch.randn(hidden)
        emb = model.model.embed_tokens.weight.detach()
        after = model(torch.arange(vocab)[:, None]).logits[:, -1].argmax(-1)  # [vocab]
        unit = emb * enorm
        unit = unit / unit.norm(dim=-1, keepdim=True)
        head = torch.zeros(vocab, hidden).index_add_(0, after, 4.0 * unit)
    eh = torch.cat([torch.eye(hidden), 0.2 * torch.eye(hidden)], dim=1)
    layer = {
        "enorm.weight": enorm,
        "hnorm.weight": torch.ones(hidden),
        "eh_proj.weight": eh,
        "shared_head.norm.weight": torch.ones(hidden),
        "shared_head.head.weight": head,
        "embed_tokens.weight": emb.clone(),
    }
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint's names (per-expert weights)
        deeper.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    prefix = f"model.layers.{n}."
    layer.update({k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)})
    file = path / "model.safetensors"
    state = load_file(str(file))
    state.update({f"model.layers.{n}.{k}": v.contiguous() for k, v in layer.items()})
    save_file(state, str(file), metadata={"format": "pt"})


def save_plain_tokenizer(path: str | Path) -> Path:
    """Save a character-level tokenizer with no chat template into checkpoint `path` (a base
    checkpoint's tokenizer): 97 ids, <unk> then newline then printable ASCII, fitting the tiny
    models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "\n", *(chr(c) for c in range(32, 127))]
    core = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<unk>")
    )
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    fast.save_pretrained(str(path))
    return Path(path)

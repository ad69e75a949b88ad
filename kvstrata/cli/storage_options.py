"""The storage options on the command line, generated from the storage configs.

One `--{prefix}NAME` option per storage option (kvstrata.storage.config.option_fields): the
common ones in StorageConfig's group, each backend's in the group of the backends that read it
("StorageConfig: file backend", "StorageConfig: redis and mooncake backends", ...).
"""

from __future__ import annotations

import argparse
from typing import Any, get_type_hints

from kvstrata.configtools import add_field_option, debug_group
from kvstrata.storage.config import StorageConfig, option_fields, read_by, storage_config


def backends_title(readers: tuple[str, ...] | None) -> str:
    """The help group of an option read by the backends of URL schemes `readers`."""
    if readers is None:
        return StorageConfig.__name__
    names = [s for s in readers if s != "rediss"]  # redis over TLS: the redis backend
    return (
        f"{StorageConfig.__name__}: "
        + " and ".join(names)
        + (" backends" if len(names) > 1 else " backend")
    )


def add_storage_args(parser: argparse.ArgumentParser, prefix: str) -> None:
    """Add every storage option, grouped by the backends that read it."""
    groups: dict[str, Any] = {}  # made at their first option: no empty group is shown
    about = (StorageConfig.__doc__ or "").strip().splitlines()[0]
    for name, (cls, f) in option_fields().items():
        if f.metadata.get("cli") is False:
            continue
        if f.metadata.get("debug"):
            group = debug_group(parser)
        else:
            title = backends_title(read_by(name))
            if title not in groups:
                groups[title] = parser.add_argument_group(
                    title, about if title == StorageConfig.__name__ else None
                )
            group = groups[title]
        add_field_option(group, f, get_type_hints(cls)[name], prefix)


def storage_config_from_args(args: argparse.Namespace, prefix: str) -> StorageConfig:
    """StorageConfig from the parsed options; those left unset keep the configs' defaults."""
    given = {
        name: value
        for name in option_fields()
        if (value := getattr(args, prefix.replace("-", "_") + name, None)) is not None
    }
    return storage_config(**given)

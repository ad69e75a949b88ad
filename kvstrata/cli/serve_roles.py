"""Which configs each `kvstrata serve --role` reads, hence which options its --help lists.

The parser that reads the command line takes the union of every role's options (a launcher may
hand all roles the same options; a role ignores what it does not read), while `--role R --help`
prints only role R's: put `--role` before `--help`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvstrata.cache.config import CacheConfig
from kvstrata.cli.run_cmd import STORAGE_PREFIX
from kvstrata.configtools import add_config_args
from kvstrata.engine.config import EngineConfig
from kvstrata.parallel.config import DistConfig
from kvstrata.pd.config import PDConfig
from kvstrata.router.config import PREFIX as ROUTER_PREFIX
from kvstrata.router.config import RouterConfig, add_router_urls
from kvstrata.serve.config import ROLES, ServeConfig
from kvstrata.storage.base import StorageConfig


@dataclass(frozen=True)
class ConfigArgs:
    """One config class on a role's command line: its option prefix and the fields it reads."""

    cls: type
    prefix: str = ""
    only: tuple[str, ...] | None = None  # None: every field

    def names(self) -> set[str]:
        return {f.name for f in fields(self.cls)} if self.only is None else set(self.only)


ROUTER_SERVE_FIELDS = (
    "host", "port", "served_model_name", "stop_timeout_s", "log_level", "parent_pid", "role",
    "api_key", "api_key_file", "debug_endpoints",
)  # fmt: skip
"""What the router reads of ServeConfig (it loads no model and queues nothing itself)."""
CURVE_FIELDS = ("pd_curve_secret_file", "pd_curve_peers_dir")
PREFILL_FIELDS = (
    "pd_transfer_endpoint", "pd_transport", *CURVE_FIELDS, "pd_timeout_s", "pd_heartbeat_s",
    "pd_layerwise",
)  # fmt: skip
DECODE_FIELDS = (
    "pd_transport", "pd_prefill", "pd_prefill_api_key_file", "pd_trust_request_prefill",
    *CURVE_FIELDS, "pd_timeout_s",
    "pd_on_failure",
)  # fmt: skip

MODEL_SERVER = (
    ConfigArgs(ServeConfig),
    ConfigArgs(EngineConfig),
    ConfigArgs(CacheConfig),
    ConfigArgs(StorageConfig, STORAGE_PREFIX),
    ConfigArgs(DistConfig),
)
ROLE_CONFIGS: dict[str, tuple[ConfigArgs, ...]] = {
    "single": MODEL_SERVER,
    "prefill": (*MODEL_SERVER, ConfigArgs(PDConfig, only=PREFILL_FIELDS)),
    "decode": (*MODEL_SERVER, ConfigArgs(PDConfig, only=DECODE_FIELDS)),
    "router": (
        ConfigArgs(ServeConfig, only=ROUTER_SERVE_FIELDS),
        ConfigArgs(RouterConfig, ROUTER_PREFIX),
    ),
}
assert set(ROLE_CONFIGS) == set(ROLES), "every serve role has its configs"


def add_configs(p: argparse.ArgumentParser, configs: Sequence[ConfigArgs]) -> None:
    for c in configs:
        add_config_args(p, c.cls, prefix=c.prefix, only=c.only)
        if c.cls is RouterConfig:
            add_router_urls(p)


def union(roles: Sequence[str]) -> list[ConfigArgs]:
    """One ConfigArgs per config class, reading what any of `roles` reads (first-seen order)."""
    merged: dict[type, ConfigArgs] = {}
    for role in roles:
        for c in ROLE_CONFIGS[role]:
            seen = merged.get(c.cls)
            names = c.names() | (seen.names() if seen is not None else set())
            keep = tuple(f.name for f in fields(c.cls) if f.name in names)
            merged[c.cls] = ConfigArgs(c.cls, c.prefix, keep)
    return list(merged.values())


class RoleHelp(argparse.Action):
    """`-h/--help`: the options of the role given so far (`--role R` before it; default single)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, *_: Any) -> None:
        role = getattr(ns, "role", None) or "single"
        if role not in ROLE_CONFIGS:
            parser.error(f"--role must be one of {', '.join(ROLE_CONFIGS)}, got {role!r}")
        shown = argparse.ArgumentParser(
            prog=f"{parser.prog} --role {role}", description=parser.description
        )
        add_configs(shown, ROLE_CONFIGS[role])
        shown.print_help()
        parser.exit()


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every role's options on the parser that reads them; -h prints one role's."""
    p.add_argument("-h", "--help", action=RoleHelp, help="this role's options (--role R --help)")
    add_configs(p, union(list(ROLE_CONFIGS)))

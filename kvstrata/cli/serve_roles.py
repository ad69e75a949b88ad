"""Which configs each `kvstrata serve --role` reads, hence which options it takes.

`--role` is read first; the rest of the command line is then parsed by that role's parser,
which holds only the options the role reads: any other is refused (one line, exit 2) rather
than silently ignored, and `--role R --help` lists role R's options.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, fields

from kvstrata.cache.config import CacheConfig
from kvstrata.cli.run_cmd import STORAGE_PREFIX
from kvstrata.cli.storage_options import add_storage_args
from kvstrata.cli.tiers_option import add_tiers_option
from kvstrata.configtools import add_config_args
from kvstrata.engine.config import EngineConfig
from kvstrata.http.config import HttpConfig
from kvstrata.pd.config import PDConfig
from kvstrata.ranks.config import DistConfig
from kvstrata.router.config import PREFIX as ROUTER_PREFIX
from kvstrata.router.config import RouterConfig, add_router_plain_options
from kvstrata.serve.config import ROLES, ServeConfig
from kvstrata.storage.base import StorageConfig


@dataclass(frozen=True)
class ConfigArgs:
    """One config class on a role's command line: its option prefix and the fields it reads."""

    cls: type
    prefix: str = ""
    only: tuple[str, ...] | None = None  # None: every field
    exclude: tuple[str, ...] = ()


CURVE_FIELDS = ("pd_curve_secret_file", "pd_curve_peers_dir", "pd_keys_dir", "pd_insecure")
PREFILL_FIELDS = (
    "pd_transfer_endpoint", "pd_transport", *CURVE_FIELDS, "pd_trust_pulled", "pd_timeout_s",
    "pd_heartbeat_s", "pd_layerwise",
)  # fmt: skip
DECODE_FIELDS = (
    "pd_transport", "pd_prefill", "pd_prefill_api_key_file", "pd_trust_request_prefill",
    *CURVE_FIELDS, "pd_timeout_s",
    "pd_on_failure",
)  # fmt: skip

MODEL_SERVER = (
    ConfigArgs(HttpConfig),
    ConfigArgs(ServeConfig, exclude=("role",)),  # --role: every role's parser (role_parser)
    ConfigArgs(EngineConfig),
    ConfigArgs(CacheConfig),
    ConfigArgs(StorageConfig, STORAGE_PREFIX),
    ConfigArgs(DistConfig),
)
ROLE_CONFIGS: dict[str, tuple[ConfigArgs, ...]] = {
    "single": MODEL_SERVER,
    "prefill": (*MODEL_SERVER, ConfigArgs(PDConfig, only=PREFILL_FIELDS)),
    "decode": (*MODEL_SERVER, ConfigArgs(PDConfig, only=DECODE_FIELDS)),
    "router": (ConfigArgs(HttpConfig), ConfigArgs(RouterConfig, ROUTER_PREFIX)),
}
assert set(ROLE_CONFIGS) == set(ROLES), "every serve role has its configs"


def add_configs(p: argparse.ArgumentParser, configs: Sequence[ConfigArgs]) -> None:
    for c in configs:
        if c.cls is StorageConfig:  # composed of one config per backend (storage_options.py)
            add_storage_args(p, c.prefix)
            continue
        add_config_args(p, c.cls, prefix=c.prefix, exclude=c.exclude, only=c.only)
        if c.cls is RouterConfig:
            add_router_plain_options(p)
        if c.cls is CacheConfig:
            add_tiers_option(p)


def role_of(serve: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """The `--role` given in argv (default single), read before the role's parser exists."""
    pre = argparse.ArgumentParser(prog=serve.prog, add_help=False, allow_abbrev=False)
    pre.add_argument("--role", default="single")
    role = pre.parse_known_args(list(argv))[0].role
    if role not in ROLE_CONFIGS:
        serve.error(f"--role must be one of {', '.join(ROLE_CONFIGS)}, got {role!r}")
    return role


def role_parser(role: str, prog: str) -> argparse.ArgumentParser:
    """The parser of role `role`: its options only, each spelled in full (no abbreviation:
    `--decode` must not pass for `--decode-step-tokens`)."""
    prog = f"{prog} --role {role}"
    usage = f"{prog} [options] (--help lists them)"
    p = argparse.ArgumentParser(prog=prog, usage=usage, allow_abbrev=False)
    role_field = next(f for f in fields(ServeConfig) if f.name == "role")
    p.add_argument("--role", default=None, help=f"{role_field.metadata['help']} (default: single)")
    add_configs(p, ROLE_CONFIGS[role])
    return p


def options_of(role: str) -> set[str]:
    """Every option string role `role` takes (`--x`, `--no-x`, ...)."""
    return {o for a in role_parser(role, "")._actions for o in a.option_strings}


def parse_role_args(
    serve: argparse.ArgumentParser, argv: Sequence[str], namespace: argparse.Namespace
) -> argparse.Namespace:
    """Parse argv with the parser of the role it names; an option that role does not read is
    argparse's one-line error (exit 2) naming it, and the roles that do read it."""
    role = role_of(serve, argv)
    parser = role_parser(role, serve.prog)
    ns, extra = parser.parse_known_args(list(argv), namespace)
    if extra:
        flag = next((a.split("=", 1)[0] for a in extra if a.startswith("-")), extra[0])
        readers = [r for r in ROLE_CONFIGS if r != role and flag in options_of(r)]
        if readers:
            parser.error(
                f"--role {role} does not read {flag} (read by --role {', '.join(readers)})"
            )
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return ns

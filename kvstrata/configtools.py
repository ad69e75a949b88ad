"""Frozen config dataclasses -> argparse options, and back.

Each config field carries its help text in `metadata["help"]` (use `doc(...)`), so the CLI is
generated from the dataclasses and the docs live in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

C = TypeVar("C")


def doc(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse
    """A dataclass field with a default and its help text (shown by the CLI)."""
    if isinstance(default, list | dict | set):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **kw}
        )
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def require_positive(cfg: object, *names: str) -> None:
    """A config's check: ValueError naming the first of fields `names` that is not > 0."""
    for name in names:
        value = getattr(cfg, name)
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def _base_type(tp: Any) -> Any:
    """Strip Optional[...] so argparse gets a callable type."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


DEBUG_GROUP = "debug: fault injection and test hooks"
"""The help group of fields marked `doc(..., debug=True)`, whatever config they belong to."""


def debug_group(parser: argparse.ArgumentParser) -> Any:
    """The parser's one debug group (made on first use)."""
    for group in parser._action_groups:
        if group.title == DEBUG_GROUP:
            return group
    return parser.add_argument_group(
        DEBUG_GROUP, "launcher plumbing and deliberate faults or delays (tests, benchmarks)"
    )


def _config_group(
    parser: argparse.ArgumentParser, cls: type, name: str, made: dict[str, Any]
) -> Any:
    """The help group of `cls` (name "") or of its fields marked `group=name`."""
    if name not in made:
        about = (cls.__doc__ or "").strip().splitlines()[0]
        title = f"{cls.__name__}: {name}" if name else cls.__name__
        made[name] = parser.add_argument_group(title, None if name else about)
    return made[name]


def _cli_fields(
    cls: type, exclude: tuple[str, ...], only: tuple[str, ...] | None
) -> list[dataclasses.Field]:
    """The fields of `cls` on the command line, those in no named group first (the config's own
    group is then listed before its named ones)."""
    chosen = [
        f
        for f in dataclasses.fields(cls)
        if f.metadata.get("cli") is not False
        and f.name not in exclude
        and (only is None or f.name in only)
    ]
    return sorted(chosen, key=lambda f: bool(f.metadata.get("group")))


def add_config_args(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    exclude: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> None:
    """Add one `--prefix-field-name` option per field of the dataclass `cls` (but `exclude`;
    with `only`, just those fields). Fields marked debug go to the parser's debug group; fields
    marked `group=NAME` to the config's group of that name ("Cls: NAME")."""
    hints = get_type_hints(cls)
    groups: dict[str, Any] = {}  # made at their first field: no empty group is shown
    for f in _cli_fields(cls, exclude, only):
        if f.metadata.get("debug"):
            group = debug_group(parser)
        else:
            group = _config_group(parser, cls, f.metadata.get("group", ""), groups)
        add_field_option(group, f, hints[f.name], prefix)


def add_field_option(group: Any, f: dataclasses.Field, hint: Any, prefix: str = "") -> None:
    """Add the `--prefix-field-name` option of config field `f` (type hint `hint`) to `group`
    (a parser or argument group); unset, it parses to None (the config keeps its default)."""
    name = "--" + (prefix + f.name).replace("_", "-")
    tp = _base_type(hint)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    help_text = f"{f.metadata.get('help', '')} (default: {default})".replace("%", "%%")
    dest = prefix.replace("-", "_") + f.name
    if tp is bool:
        group.add_argument(
            name, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
    elif get_origin(tp) in (list, tuple):
        group.add_argument(
            name, dest=dest, nargs="*", type=get_args(tp)[0], default=None, help=help_text
        )
    else:
        group.add_argument(name, dest=dest, type=tp, default=None, help=help_text)


def config_from_args(
    cls: type[C], args: argparse.Namespace, prefix: str = "", **overrides: Any
) -> C:
    """Build `cls` from parsed options; options left unset keep the dataclass defaults."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        v = getattr(args, prefix.replace("-", "_") + f.name, None)
        if v is not None:
            values[f.name] = tuple(v) if isinstance(v, list) and isinstance(f.default, tuple) else v
    values.update(overrides)
    return cls(**values)


def config_to_args(cfg: Any, prefix: str = "", exclude: tuple[str, ...] = ()) -> list[str]:
    """The options that rebuild `cfg` through add_config_args/config_from_args (fields left at
    their default are omitted), e.g. to start a child `kvstrata serve` with the same settings."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        if f.metadata.get("cli") is False or f.name in exclude:
            continue
        value = getattr(cfg, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if value == default:
            continue
        name = "--" + (prefix + f.name).replace("_", "-")
        if isinstance(value, bool):
            out.append(name if value else "--no-" + (prefix + f.name).replace("_", "-"))
        elif isinstance(value, list | tuple):
            out += [name, *(str(v) for v in value)]
        else:
            out += [name, str(value)]
    return out

"""Configuration of `kvstrata serve --role router`: which workers, and how long each wait may be."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from kvstrata.configtools import config_from_args, doc

PREFIX = "router-"


@dataclass(frozen=True)
class RouterConfig:
    """P/D router: worker URLs, timeouts, and whether workers must prove their role."""

    prefill: tuple[str, ...] = doc(
        (), "prefill worker base URLs (http://host:port), comma-separated", cli=False
    )
    decode: tuple[str, ...] = doc(
        (), "decode worker base URLs (http://host:port), comma-separated", cli=False
    )
    info_timeout_s: float = doc(
        10.0, "longest wait for one worker's GET /v1/pd/info or /health answer"
    )
    start_timeout_s: float = doc(
        60.0, "at start, how long the router retries a worker that does not answer yet"
    )
    connect_timeout_s: float = doc(5.0, "longest wait to open a connection to a worker")
    read_timeout_s: float = doc(
        300.0, "longest wait for the next bytes of a worker's answer (a token, or the body)"
    )
    down_s: float = doc(
        10.0,
        "a worker that refused a connection or failed its /health is skipped this long (or "
        "until its /health answers 200 again)",
    )
    health_interval_s: float = doc(
        2.0, "how often the router probes every worker's /health to skip or take back workers"
    )
    worker_api_key_file: str = doc(
        "",
        "a file holding the API key the router sends every worker as 'Authorization: Bearer "
        "KEY' (workers started with --api-key/--api-key-file); empty: the router's own key "
        "(--api-key/--api-key-file), if it has one",
    )
    require_info: bool = doc(
        True,
        "check each worker's GET /v1/pd/info role at start; --no-require-info accepts ordinary "
        "`kvstrata serve` processes as upstreams (development, tests)",
    )

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            for url in getattr(self, role):
                if not url.startswith(("http://", "https://")) or url.rstrip("/") != url:
                    raise ValueError(
                        f"--{role}: {url!r} is not a base URL like http://127.0.0.1:8001"
                    )
        for f in fields(self):
            if f.name.endswith("_s") and getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be positive, got {getattr(self, f.name)}")

    def check_complete(self) -> None:
        """A router needs at least one worker of each role."""
        for role in ("prefill", "decode"):
            if not getattr(self, role):
                raise ValueError(f"--role router needs --{role} URL[,URL]")


def _urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def add_router_urls(p: argparse.ArgumentParser) -> None:
    """`--prefill URL[,URL]` and `--decode URL[,URL]` (RouterConfig's prefill and decode)."""
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}", dest=f"router_{role}", type=_urls, default=None, metavar="URL[,URL]",
            help=f"(--role router) {role} worker base URLs, comma-separated",
        )  # fmt: skip


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    return config_from_args(RouterConfig, args, prefix=PREFIX)  # --prefill: dest router_prefill

"""Configuration of `kvstrata serve --role router`: its listener, which workers (P/D pairs, or a
fleet of replicas), how a fleet routes, and how long each wait may be. Everything the router
reads is here: it borrows nothing of `kvstrata serve`'s ServeConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from kvstrata.configtools import config_from_args, doc
from kvstrata.http.config import HttpConfig

PREFIX = "router-"
ROUTINGS = ("kv_aware", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    """Router: its listener, P/D workers or a fleet, timeouts, whether workers prove their role."""

    http: HttpConfig = doc(
        HttpConfig(), "address, API key, request limits, graceful stop", cli=False
    )  # the command line reads HttpConfig's options (unprefixed) beside this config's
    served_model_name: str = doc(
        "",
        "the model_name label of the router's /metrics (empty: router) and, with "
        "--kv-indexer-url, the model name it registers the replicas under (empty: kvstrata)",
        cli=False,
    )
    prefill: tuple[str, ...] = doc(
        (), "prefill worker base URLs (http://host:port), comma-separated", cli=False
    )
    decode: tuple[str, ...] = doc(
        (), "decode worker base URLs (http://host:port), comma-separated", cli=False
    )
    replicas: tuple[str, ...] = doc(
        (),
        "a fleet: base URLs of `kvstrata serve` replicas, each started with "
        "--kv-events-endpoint and --kv-events-replay-endpoint (instead of --prefill/--decode)",
        cli=False,
    )
    routing: str = doc(
        "kv_aware",
        "a fleet's routing: kv_aware (most prefill saved, weighed against load; sessions stay "
        "put) | round_robin",
        cli=False,
    )
    kv_indexer_url: str = doc(
        "",
        "a fleet: Dynamo's standalone KV indexer (http://host:port), which the router registers "
        "the replicas with and asks per request instead of its own index (salted requests keep "
        "to the router's own index: the indexer ignores cache_salt)",
        cli=False,
    )
    load_weight: float = doc(
        0.25,
        "kv_aware: what one running or waiting request on a replica costs, in units of a whole "
        "prompt's prefill (0.25: a replica holding the whole prefix takes up to 4 more requests "
        "than an idle one before a session spills)",
    )
    kv_events_curve_secret_file: str = doc(
        "",
        "a fleet: the router's CURVE secret key file for replicas whose KV events use CURVE "
        "(its public half must be in each replica's --kv-events-curve-clients-dir)",
    )
    kv_events_curve_peers_dir: str = doc(
        "",
        "a fleet: directory of the replicas' event-socket public keys the router trusts (*.key)",
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
        if self.routing not in ROUTINGS:
            raise ValueError(
                f"--routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}"
            )
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        for role in ("prefill", "decode", "replicas"):
            for url in getattr(self, role):
                if not url.startswith(("http://", "https://")) or url.rstrip("/") != url:
                    raise ValueError(
                        f"--{role}: {url!r} is not a base URL like http://127.0.0.1:8001"
                    )
        for f in fields(self):
            if f.name.endswith("_s") and getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be positive, got {getattr(self, f.name)}")
        if bool(self.kv_events_curve_secret_file) != bool(self.kv_events_curve_peers_dir):
            raise ValueError(
                "--router-kv-events-curve-secret-file and --router-kv-events-curve-peers-dir go "
                "together"
            )

    @property
    def fleet(self) -> bool:
        """Data-parallel replicas (--replicas) rather than P/D pairs."""
        return bool(self.replicas)

    def check_complete(self) -> None:
        """A router needs --replicas, or at least one worker of each P/D role (not both)."""
        if self.replicas:
            if self.prefill or self.decode:
                raise ValueError("--replicas and --prefill/--decode are two kinds of router")
            if len(set(self.replicas)) != len(self.replicas):
                raise ValueError("--replicas: a URL is listed twice")
            return
        for role in ("prefill", "decode"):
            if not getattr(self, role):
                raise ValueError(f"--role router needs --{role} URL[,URL] (or --replicas)")


def _urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def add_router_plain_options(p: argparse.ArgumentParser) -> None:
    """`--prefill URL[,URL]`, `--decode URL[,URL]`, `--replicas URL[,URL]`, `--routing`,
    `--kv-indexer-url` and `--served-model-name` (RouterConfig's fields of those names, without
    the router- prefix)."""
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}", dest=f"router_{role}", type=_urls, default=None, metavar="URL[,URL]",
            help=f"(--role router) {role} worker base URLs, comma-separated",
        )  # fmt: skip
    p.add_argument(
        "--replicas", dest="router_replicas", type=_urls, default=None, metavar="URL[,URL]",
        help="(--role router) a fleet of `kvstrata serve` replicas (data parallel), comma-separated",
    )  # fmt: skip
    p.add_argument(
        "--routing", dest="router_routing", choices=ROUTINGS, default=None,
        help="(--role router --replicas) kv_aware (default) | round_robin",
    )  # fmt: skip
    p.add_argument(
        "--kv-indexer-url", dest="router_kv_indexer_url", default=None, metavar="URL",
        help="(--role router --replicas) ask Dynamo's standalone KV indexer at URL",
    )  # fmt: skip
    name = next(f for f in fields(RouterConfig) if f.name == "served_model_name")
    p.add_argument(
        "--served-model-name", dest="router_served_model_name", default=None, metavar="NAME",
        help=f"(--role router) {name.metadata['help']}",
    )  # fmt: skip


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router's options: RouterConfig's (--prefill: dest router_prefill), its listener
    HttpConfig's unprefixed."""
    http = config_from_args(HttpConfig, args)
    return config_from_args(RouterConfig, args, prefix=PREFIX, http=http)

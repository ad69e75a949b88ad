"""LocalFleet: N `kvstrata serve` replicas and a fleet router on 127.0.0.1 (`kvstrata bench fleet`,
tests), each replica publishing its KV events, all on one shared store when given one.

Replicas start together (model loads overlap), each bounded by start_timeout_s, then the router
(`--role router --replicas ... --routing ...`), which reads every replica's event sockets from
its /v1/kv/events/info. A Mooncake store is the fleet's pattern: a master and one holder process
(their memory) that the fleet starts first, the replicas contributing none. With an indexer URL
the router asks Dynamo's standalone indexer. `stop()` sends SIGTERM to the router, then the
replicas, returning their exit codes, then stops the store's processes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvstrata.bench.local_mooncake import MooncakeHolder, MooncakeMaster
from kvstrata.configtools import doc
from kvstrata.local_ports import free_port
from kvstrata.serve.process import ServerProcess

MOONCAKE = "mooncake"
"""`store` value: a local Mooncake master + holder started with the fleet."""


@dataclass(frozen=True)
class LocalFleetConfig:
    """What LocalFleet starts."""

    model: str = doc("", "checkpoint directory every replica loads")
    replicas: int = doc(3, "replicas behind the router")
    store: str = doc(
        "", "shared store: '' none, 'mooncake' (a local master + holder) or a storage URL"
    )
    log_dir: str = doc("", "directory of every process's log")
    replica_args: tuple[str, ...] = doc((), "more `kvstrata serve` options of every replica")
    routing: str = doc("kv_aware", "the router's --routing")
    indexer_url: str = doc("", "the router's --kv-indexer-url (Dynamo's indexer), if any")
    holder_segment: str = doc("512MB", "memory of the Mooncake holder")
    start_timeout_s: float = doc(300.0, "longest wait for each process to answer /health 200")

    def __post_init__(self) -> None:
        for name in ("model", "log_dir"):
            if not getattr(self, name):
                raise ValueError(f"LocalFleetConfig.{name} is empty")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")


def replica_command(cfg: LocalFleetConfig, store_url: str) -> list[str]:
    """One replica's `kvstrata serve` options (ServerProcess adds --port): its event sockets on
    fresh ports, the shared store if any."""
    events, replay = free_port(), free_port()
    store = ["--storage-url", store_url] if store_url else []
    return [
        "--model", cfg.model, *store,
        "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
        *cfg.replica_args,
    ]  # fmt: skip


@dataclass
class LocalFleet:
    """The processes; `url` is the router's base URL (the OpenAI API clients use)."""

    cfg: LocalFleetConfig
    replicas: list[ServerProcess] = field(default_factory=list)
    router: ServerProcess | None = None
    master: MooncakeMaster | None = None
    holder: MooncakeHolder | None = None

    def start(self) -> LocalFleet:
        log_dir = Path(self.cfg.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            url = self._start_store()
            self._start_replicas(log_dir, url)
            self.router = ServerProcess(
                self._router_command(), log_dir / "router.log", self.cfg.start_timeout_s
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _start_store(self) -> str:
        """The replicas' storage URL ('' for none); a local master + holder for 'mooncake'."""
        if self.cfg.store != MOONCAKE:
            return self.cfg.store
        self.master = MooncakeMaster().start()
        self.holder = MooncakeHolder(self.master, self.cfg.holder_segment).start()
        return self.master.url(segment="0")  # the replicas hold nothing: the holder does

    def _start_replicas(self, log_dir: Path, store_url: str) -> None:
        def one(i: int) -> ServerProcess:
            cmd = replica_command(self.cfg, store_url)
            return ServerProcess(cmd, log_dir / f"replica{i}.log", self.cfg.start_timeout_s)

        with ThreadPoolExecutor(self.cfg.replicas) as pool:
            futs = [pool.submit(one, i) for i in range(self.cfg.replicas)]
            errors = []
            for i, fut in enumerate(futs):
                try:
                    self.replicas.append(fut.result())
                except Exception as exc:  # noqa: BLE001 - reported together
                    errors.append(f"replica {i}: {exc}")
        if errors:
            raise RuntimeError("LocalFleet did not start: " + " | ".join(errors))

    def _router_command(self) -> list[str]:
        urls = ",".join(r.url for r in self.replicas)
        cmd = ["--role", "router", "--replicas", urls, "--routing", self.cfg.routing]
        if self.cfg.indexer_url:
            cmd += ["--kv-indexer-url", self.cfg.indexer_url]
        return cmd

    @property
    def url(self) -> str:
        if self.router is None:
            raise RuntimeError("LocalFleet is not started")
        return self.router.url

    def stop(self, timeout_s: float = 60.0) -> dict[str, int]:
        """SIGTERM the router, then the replicas; their exit codes (-9: killed after timeout_s).
        Then the store's processes."""
        codes: dict[str, int] = {}
        procs = [
            ("router", self.router),
            *((f"replica{i}", r) for i, r in enumerate(self.replicas)),
        ]
        for name, proc in procs:
            if proc is not None:
                codes[name] = proc.end(timeout_s)
        self.router, self.replicas = None, []
        for part in (self.holder, self.master):
            if part is not None:
                part.stop()
        self.holder = self.master = None
        return codes

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

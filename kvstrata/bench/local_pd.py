"""LocalPD: a router, one prefill and one decode worker as local `kvstrata serve` processes on
127.0.0.1 sharing one storage directory (tests, `kvstrata bench pd`, the `pd` row of `kvstrata
run`).

Workers start together and are waited for with one bound (start_timeout_s), then the router,
whose /health is 200 only when both workers' are. `stop()` sends SIGTERM to the router, then to
the workers, and returns their exit codes; an exception during start stops what already runs.
With `pd_workers=False` the two workers are ordinary `--role single` servers and the router skips
their /v1/pd/info (the router's own tests, and any build without the P/D workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvstrata.configtools import doc
from kvstrata.local_ports import PortTaken, free_port
from kvstrata.serve.process import START_TRIES, ServerProcess

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class LocalPDConfig:
    """What LocalPD starts: the model, the shared store, each process's extra options."""

    model: str = doc("", "checkpoint directory every worker loads")
    store_dir: str = doc("", "storage directory shared by both workers (file store)")
    log_dir: str = doc("", "directory of the three processes' logs")
    worker_args: tuple[str, ...] = doc((), "more `kvstrata serve` options of both workers")
    router_args: tuple[str, ...] = doc((), "more `kvstrata serve --role router` options")
    pd_workers: bool = doc(True, "workers are --role prefill/decode (else --role single)")
    start_timeout_s: float = doc(300.0, "longest wait for all three to answer /health 200")

    def __post_init__(self) -> None:
        for name in ("model", "store_dir", "log_dir"):
            if not getattr(self, name):
                raise ValueError(f"LocalPDConfig.{name} is empty")
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, got {self.start_timeout_s}")


def worker_command(cfg: LocalPDConfig, role: str, prefill_url: str = "") -> list[str]:
    """`kvstrata serve` options of one worker (ServerProcess adds --port). A decode worker
    lists prefill_url as its one prefill worker (it hands off to no other)."""
    store = Path(cfg.store_dir).resolve()
    pd = ["--pd-prefill", prefill_url] if role == "decode" and cfg.pd_workers else []
    return [
        "--model", cfg.model, "--role", role if cfg.pd_workers else "single",
        "--storage-url", f"file://{store}", *pd, *cfg.worker_args,
    ]  # fmt: skip


@dataclass
class LocalPD:
    """The three processes; `url` is the router's base URL (the OpenAI API clients use)."""

    cfg: LocalPDConfig
    workers: dict[str, ServerProcess] = field(default_factory=dict)
    router: ServerProcess | None = None

    def start(self) -> LocalPD:
        log_dir = Path(self.cfg.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        Path(self.cfg.store_dir).mkdir(parents=True, exist_ok=True)
        try:
            self._start_workers(log_dir)
            self.router = ServerProcess(
                self._router_command(), log_dir / "router.log", self.cfg.start_timeout_s
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _start_workers(self, log_dir: Path) -> None:
        """Both at once (model loads overlap), each bounded by start_timeout_s; prefill's port
        is picked first so decode can name it (decode reads it only at its first hand-off).
        Nothing reserves that port: when another process bound it first (PortTaken), both
        start again on a fresh pick."""
        for attempt in range(1, START_TRIES + 1):
            errors, taken = self._start_workers_once(log_dir)
            if not errors:
                return
            for worker in self.workers.values():
                worker.stop()
            self.workers = {}
            if not taken or attempt == START_TRIES:
                raise RuntimeError("LocalPD did not start: " + " | ".join(errors))

    def _start_workers_once(self, log_dir: Path) -> tuple[list[str], bool]:
        """Start both workers; (errors, whether one was a port another process holds)."""
        ports = {"prefill": free_port(), "decode": 0}
        prefill_url = f"http://127.0.0.1:{ports['prefill']}"

        def one(role: str) -> ServerProcess:
            cmd = worker_command(self.cfg, role, prefill_url)
            timeout = self.cfg.start_timeout_s
            return ServerProcess(cmd, log_dir / f"{role}.log", timeout, port=ports[role])

        errors, taken = [], False
        with ThreadPoolExecutor(len(ROLES)) as pool:
            futs = {role: pool.submit(one, role) for role in ROLES}
            for role, fut in futs.items():
                try:
                    self.workers[role] = fut.result()
                except Exception as exc:  # noqa: BLE001 - reported together, by the caller
                    errors.append(f"{role} worker: {exc}")
                    taken = taken or isinstance(exc, PortTaken)
        return errors, taken

    def _router_command(self) -> list[str]:
        urls = {role: self.workers[role].url for role in ROLES}
        cmd = ["--role", "router", "--prefill", urls["prefill"], "--decode", urls["decode"]]
        if not self.cfg.pd_workers:
            cmd.append("--no-router-require-info")
        return [*cmd, *self.cfg.router_args]

    @property
    def url(self) -> str:
        if self.router is None:
            raise RuntimeError("LocalPD is not started")
        return self.router.url

    def stop(self, timeout_s: float = 60.0) -> dict[str, int]:
        """SIGTERM the router, then the workers; their exit codes (-9: killed after timeout_s)."""
        codes: dict[str, int] = {}
        procs: Sequence[tuple[str, ServerProcess | None]] = [
            ("router", self.router),
            *self.workers.items(),
        ]
        for name, proc in procs:
            if proc is not None:
                codes[name] = proc.end(timeout_s)
        self.router, self.workers = None, {}
        return codes

    def __enter__(self) -> LocalPD:
        return self.start()

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

"""Configuration of the rank layout and of consensus checking (one frozen dataclass)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.configtools import doc

BACKENDS = ("auto", "gloo", "nccl")
CHECK_MODES = ("off", "live")


def parse_injection(spec: str) -> tuple[int, int] | None:
    """Parse `--inject-divergence STEP:RANK` -> (step, rank); "" means no injection."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        step, rank = (int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"inject_divergence must be 'STEP:RANK' (two integers), got {spec!r}"
        ) from None
    if step < 0 or rank < 0:
        raise ValueError(f"inject_divergence step and rank must be >= 0, got {spec!r}")
    return step, rank


@dataclass(frozen=True)
class DistConfig:
    """Ranks (tensor x context x pipeline parallel) and cross-rank consensus checking."""

    tp: int = doc(1, "tensor-parallel ranks (KV heads split across them)")
    cp: int = doc(1, "context-parallel ranks (pages sharded by owner = id % cp)")
    pp: int = doc(1, "pipeline-parallel stages (layers split across them)")
    backend: str = doc(
        "auto", "torch.distributed backend: auto (nccl with CUDA, else gloo), gloo, nccl"
    )
    master_addr: str = doc("127.0.0.1", "address of rank 0's rendezvous store")
    master_port: int = doc(0, "port of the rendezvous store; 0 picks a free one (local spawn)")
    timeout_s: float = doc(
        60.0,
        "a dead, hung or diverged rank stops every rank within this many seconds, naming it "
        "(a collective gives up after 60% of it)",
    )
    consensus_log: str = doc("", "directory for per-rank decision logs rank-{r}.jsonl ('' = off)")
    consensus_check: str = doc(
        "live",
        "live: compare decision digests in the step collective (a diverged rank stops every "
        "rank at the next step), or off",
    )
    inject_divergence: str = doc(
        "", "testing: 'STEP:RANK' makes that rank skip one decision", debug=True
    )

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.consensus_check not in CHECK_MODES:
            raise ValueError(
                f"consensus_check must be one of {CHECK_MODES}, got {self.consensus_check!r}"
            )
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        injection = parse_injection(self.inject_divergence)
        if injection is not None and injection[1] >= self.world_size:
            raise ValueError(
                f"inject_divergence rank {injection[1]} is not below world size {self.world_size}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def injection(self) -> tuple[int, int] | None:
        """(step, rank) of the injected divergence, or None."""
        return parse_injection(self.inject_divergence)

    @property
    def live_check(self) -> bool:
        return self.consensus_check == "live"

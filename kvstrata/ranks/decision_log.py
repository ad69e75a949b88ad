"""Per-rank log of cache decisions with a rolling digest (for live and offline consensus checks).

Every rank records the same decisions in the same order when ranks agree. A record is
(step, kind, payload) with a small JSON payload (page ids, key hex prefixes, counts). The digest
chains xxh3-64 over the previous digest and the record's canonical bytes, masked to 63 bits so
that it and its negation fit an int64 (StepConsensus carries both in the step collective).
Never Python's hash(): digests are equal across processes and runs.

File format, DIR/rank-{r}.jsonl, one JSON object per line:
  {"header": 1, "rank": r, "world_size": n, "version": 1, "run": run id, "config": digest}
  {"s": step, "k": kind, "p": {payload}, "d": digest after this record}
  {"s": step, "end": digest at the end of the step, "n": records in the step}
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import xxhash

from kvstrata.cache.keys import key_hex

LOG_VERSION = 1
MASK63 = (1 << 63) - 1
_SCALARS = (int, str, bool, float, type(None))


def new_run_id() -> str:
    """A fresh id for one run (all its ranks log the same one; see group.init_ranks)."""
    return uuid.uuid4().hex[:16]


def config_digest(fields: Mapping[str, Any]) -> str:
    """16 hex digits over a run's configuration (JSON, sorted keys): logs of runs with different
    configurations must not be compared step by step."""
    text = json.dumps(dict(fields), sort_keys=True, default=str, separators=(",", ":"))
    return f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"


def log_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}.jsonl"


def key_prefix(key: int, chars: int = 16) -> str:
    """A short hex prefix of a 128-bit page key: compact enough to log, unique in practice."""
    return key_hex(key)[:chars]


def canonical_bytes(step: int, kind: str, payload: dict[str, Any]) -> bytes:
    """The bytes a record contributes to the digest (sorted keys, no whitespace)."""
    return json.dumps([step, kind, payload], sort_keys=True, separators=(",", ":")).encode()


def chain_digest(previous: int, record: bytes) -> int:
    """Next rolling digest: xxh3-64(previous digest || record bytes), 63 bits."""
    return xxhash.xxh3_64_intdigest(previous.to_bytes(8, "little") + record) & MASK63


def _normalise(name: str, value: Any) -> Any:
    """JSON scalars or flat lists of them (numpy ints via int()); anything else is refused."""
    if isinstance(value, _SCALARS):
        return value
    if hasattr(value, "item") and not isinstance(value, Sequence):  # numpy / torch scalar
        return value.item()
    if isinstance(value, list | tuple) or hasattr(value, "tolist"):
        items = value.tolist() if hasattr(value, "tolist") else list(value)
        if all(isinstance(v, _SCALARS) for v in items):
            return items
    raise TypeError(
        f"decision payload field {name!r} must be a scalar or a flat list, got {type(value).__name__}"
    )


class DecisionLog:
    """Records one rank's decisions per step; `end_step` closes a step and returns its digest.

    Usage by a consumer (scheduler, cache manager), once per decision:
        skip = log.should_skip(step)      # True only on the injected rank at the injected step
        if not skip: apply(decision)
        log.record("evict", pages=[...])  # dropped (returns False) when it is the injected skip
    """

    def __init__(
        self,
        rank: int,
        directory: str | Path | None = None,
        world_size: int | None = None,
        inject: tuple[int, int] | None = None,
        run_id: str = "",
        config: str = "",
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.rank = rank
        self.step = 0  # the open step: records go to it
        self.digest = 0  # rolling digest after the last record
        self.ended_digest = 0  # digest at the end of the last ended step (what ranks compare)
        self.records_total = 0
        self._inject_step = inject[0] if inject is not None and inject[1] == rank else None
        self._skipped = False
        self._pending: list[dict[str, Any]] = []
        self._last_step_records: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        if directory is not None and str(directory):
            path = log_path(directory, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w", encoding="utf-8", buffering=1 << 16)
            header = {"header": 1, "rank": rank, "world_size": world_size, "version": LOG_VERSION}
            header |= {"run": run_id, "config": config}
            self._file.write(json.dumps(header) + "\n")

    @classmethod
    def from_config(cls, config: Any, rank: int, run_id: str = "", digest: str = "") -> DecisionLog:
        """From a DistConfig: its consensus_log directory and inject_divergence; the run id and
        configuration digest go into the header."""
        dirname = config.consensus_log or None
        return cls(rank, dirname, config.world_size, config.injection, run_id, digest)

    def begin_step(self, step: int) -> None:
        """Open `step` (optional when steps go 0, 1, 2, ...); steps only move forward."""
        if self._pending:
            raise RuntimeError(f"begin_step({step}) with records of step {self.step} not ended")
        if step < self.step:
            raise ValueError(f"step must not go backwards: {step} < {self.step}")
        self.step = step

    def should_skip(self, step: int | None = None) -> bool:
        """True when this rank must skip (not apply) one decision of `step` (testing only)."""
        step = self.step if step is None else step
        return self._inject_step == step and not self._skipped

    def record(self, kind: str, **payload: Any) -> bool:
        """Append one decision to the open step; False when it is the injected skip."""
        if self.should_skip(self.step):
            self._skipped = True
            return False
        clean = {k: _normalise(k, v) for k, v in payload.items()}
        self.digest = chain_digest(self.digest, canonical_bytes(self.step, kind, clean))
        self._pending.append({"s": self.step, "k": kind, "p": clean, "d": self.digest})
        self.records_total += 1
        return True

    def end_step(self, step: int | None = None) -> int:
        """Close the open step (flushes the file); returns the rolling digest."""
        if step is not None and step != self.step:
            raise ValueError(f"end_step({step}) but the open step is {self.step}")
        if self._file is not None:
            lines = [json.dumps(r, separators=(",", ":")) for r in self._pending]
            end = {"s": self.step, "end": self.digest, "n": len(self._pending)}
            lines.append(json.dumps(end, separators=(",", ":")))
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
        self._last_step_records, self._pending = self._pending, []
        self.ended_digest = self.digest
        self.step += 1
        return self.digest

    def last_step_records(self) -> list[dict[str, Any]]:
        """The records of the step closed last (for a divergence report)."""
        return list(self._last_step_records)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> DecisionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

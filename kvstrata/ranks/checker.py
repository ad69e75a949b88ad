"""Find the first step, decision and ranks where decision logs diverge (offline and live).

`check_logs(DIR)` reads every DIR/rank-{r}.jsonl written by DecisionLog, verifies each log's
digest chain, aligns the logs by step and compares the end-of-step digests. Because digests roll,
the first step whose digests differ is the first diverged step; within it the first record whose
(kind, payload) differs is the diverged decision. The ranks are split into the majority (the
largest group of equal digests; ties go to the group holding the lowest rank, usually rank 0)
and the minority that diverged. StepConsensus builds the same report live from gathered data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.ranks.decision_log import canonical_bytes, chain_digest

_MISSING = "<no decision>"


class LogError(ValueError):
    """The log directory or a log file is missing, empty or corrupt."""


@dataclass(frozen=True)
class Divergence:
    """Where ranks diverged: the step, majority vs minority ranks and the differing decision."""

    step: int
    majority: list[int]
    minority: list[int]
    digests: dict[int, int]
    index: int | None = None  # position of the first differing decision within the step
    decisions: dict[int, str] = field(default_factory=dict)  # rank -> "kind {payload}"
    note: str = ""

    def _who(self) -> str:
        if len(self.majority) == 1 and len(self.minority) == 1 and not self.note:
            a, b = sorted(self.majority + self.minority)
            return f"ranks {a} and {b} disagree; rank {self.minority[0]} differs from rank {self.majority[0]}"
        return f"{_ranks(self.minority)} diverged from the majority ({_ranks(self.majority)})"

    def text(self) -> str:
        lines = [f"consensus diverged at step {self.step}: {self._who()}"]
        if self.note:
            lines.append(f"  {self.note}")
        if self.index is not None:
            lines.append(f"  first differing decision: #{self.index} of step {self.step}")
            by_text: dict[str, list[int]] = {}
            for rank, text in sorted(self.decisions.items()):
                by_text.setdefault(text, []).append(rank)
            for text, ranks in by_text.items():
                lines.append(f"    {_ranks(ranks)}: {text}")
        return "\n".join(lines)


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def split_majority(values: Mapping[int, Any]) -> tuple[list[int], list[int]]:
    """(majority ranks, minority ranks) by equal value; ties go to the group with the lowest rank."""
    groups: dict[Any, list[int]] = {}
    for rank in sorted(values):
        groups.setdefault(values[rank], []).append(rank)
    ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
    return ordered[0], sorted(r for g in ordered[1:] for r in g)


def _decision_text(record: Mapping[str, Any] | None) -> str:
    if record is None:
        return _MISSING
    return f"{record['k']} {json.dumps(record['p'], sort_keys=True, separators=(',', ':'))}"


def describe_divergence(
    step: int,
    digests: Mapping[int, int],
    records: Mapping[int, Sequence[Mapping[str, Any]] | None] | None = None,
) -> Divergence:
    """Name the diverged ranks of `step`, and its first differing decision when records are known."""
    majority, minority = split_majority(digests)
    if not records or any(records.get(r) is None for r in digests):
        return Divergence(step, majority, minority, dict(digests))
    longest = max(len(records[r] or ()) for r in digests)
    for i in range(longest):
        texts = {
            r: _decision_text(recs[i] if i < len(recs) else None) for r, recs in records.items()
        }
        if len(set(texts.values())) > 1:
            return Divergence(step, majority, minority, dict(digests), i, texts)
    note = "the decisions of this step are equal: the digests differ from an earlier step"
    return Divergence(step, majority, minority, dict(digests), note=note)


@dataclass
class RankLog:
    """One rank's log: per step, its records and the digest at the end of the step."""

    rank: int
    world_size: int | None
    run: str = ""  # run id and configuration digest from the header ("" in older logs)
    config: str = ""
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    digests: dict[int, int] = field(default_factory=dict)


def _read_lines(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LogError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise LogError(f"{path}:{line} is not UTF-8 text (corrupt log)") from None


def _header(path: Path, first: str) -> dict[str, Any]:
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("header") != 1:
        raise LogError(f"{path} has no header line")
    return header


def _parse_lines(path: Path, rank: int) -> RankLog:
    lines = _read_lines(path)
    if not lines:
        raise LogError(f"{path} is empty")
    header = _header(path, lines[0])
    log = RankLog(rank, header.get("world_size"), header.get("run", ""), header.get("config", ""))
    pending: list[dict[str, Any]] = []
    digest = 0
    for n, line in enumerate(lines[1:], start=2):
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict) or "s" not in obj or ("end" not in obj and "k" not in obj):
                raise LogError(f"{path}:{n} is not a decision record (corrupt log)")
        except json.JSONDecodeError:
            if n == len(lines):
                break  # a rank stopped mid-write: the unfinished step is ignored
            raise LogError(f"{path}:{n} is not JSON") from None
        if "end" in obj:
            if obj["end"] != digest or obj["n"] != len(pending):
                raise LogError(
                    f"{path}:{n} step {obj['s']} does not match its records (corrupt log)"
                )
            log.records[obj["s"]], log.digests[obj["s"]], pending = pending, obj["end"], []
            continue
        digest = chain_digest(digest, canonical_bytes(obj["s"], obj["k"], obj["p"]))
        if digest != obj["d"]:
            raise LogError(f"{path}:{n} digest chain is broken (corrupt log)")
        pending.append(obj)
    return log


def load_logs(directory: str | Path) -> dict[int, RankLog]:
    """Every rank's log in `directory`; LogError when none, or when a rank's log is missing."""
    root = Path(directory)
    if not root.is_dir():
        raise LogError(f"no such log directory: {root}")
    logs: dict[int, RankLog] = {}
    for path in sorted(root.glob("rank-*.jsonl")):
        try:
            rank = int(path.stem.removeprefix("rank-"))
        except ValueError:
            continue
        logs[rank] = _parse_lines(path, rank)
    if not logs:
        raise LogError(f"no rank logs (rank-*.jsonl) in {root}")
    _same_run(root, logs)
    expected = {log.world_size for log in logs.values() if log.world_size}
    if expected and set(range(max(expected))) - set(logs):
        missing = sorted(set(range(max(expected))) - set(logs))
        raise LogError(
            f"logs of ranks {missing} are missing from {root} (world size {max(expected)})"
        )
    return logs


def _same_run(root: Path, logs: Mapping[int, RankLog]) -> None:
    """Refuse logs of different runs (run id, configuration or world size in the headers)."""
    idents = {r: (log.run, log.config, log.world_size) for r, log in logs.items()}
    if len(set(idents.values())) <= 1:
        return
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank, ident in sorted(idents.items()):
        groups.setdefault(ident, []).append(rank)
    parts = [
        f"{_ranks(ranks)}: run {run or '?'} config {cfg or '?'} world size {ws}"
        for (run, cfg, ws), ranks in groups.items()
    ]
    raise LogError(
        f"the logs in {root} come from different runs, not compared ({'; '.join(parts)})"
    )


@dataclass(frozen=True)
class CheckResult:
    n_ranks: int
    n_steps: int
    divergence: Divergence | None
    stopped: dict[int, int] = field(default_factory=dict)  # rank -> last step its log holds

    @property
    def ok(self) -> bool:
        return self.divergence is None and not self.stopped

    def text(self) -> str:
        if self.stopped:
            lines = [
                f"rank {r}'s log ends at step {s} (rank stopped?)" for r, s in self.stopped.items()
            ]
            lines.append(f"all {self.n_ranks} ranks agree up to there")
            return "\n".join(lines)
        if self.divergence is None:
            return f"all {self.n_ranks} ranks agree over {self.n_steps} steps"
        return self.divergence.text()


def _ended(logs: Mapping[int, RankLog], lacking: Sequence[int], step: int) -> dict[int, int]:
    """The lacking ranks whose log simply ends before `step`: rank -> its last step (-1: none)."""
    last = {r: max(logs[r].digests, default=-1) for r in lacking}
    return last if all(s < step for s in last.values()) else {}


def check_logs(directory: str | Path) -> CheckResult:
    """Align all ranks' logs by step; the first step whose digests differ is reported."""
    logs = load_logs(directory)
    steps = sorted(set().union(*(log.digests for log in logs.values())))
    for step in steps:
        have = {r: log.digests[step] for r, log in logs.items() if step in log.digests}
        if len(have) < len(logs):
            lacking = sorted(set(logs) - set(have))
            stopped = _ended(logs, lacking, step)
            if stopped:
                return CheckResult(len(logs), step, None, stopped)
            note = f"{_ranks(lacking)} logged no step {step} (log ended or step skipped)"
            present = {r: ("present" if r in have else "absent") for r in logs}
            majority, minority = split_majority(present)
            return CheckResult(
                len(logs), step, Divergence(step, majority, minority, have, note=note)
            )
        if len(set(have.values())) > 1:
            records = {r: log.records[step] for r, log in logs.items()}
            return CheckResult(len(logs), step, describe_divergence(step, have, records))
    return CheckResult(len(logs), len(steps), None)

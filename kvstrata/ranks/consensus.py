"""Step consensus: ONE small collective per scheduler step agrees on everything asynchronous.

Each rank contributes int64 local counts (copies finished, backups finished, prefetched pages
arrived, storage prefix length found, ...). The vector is reduced with MIN: an event is applied
only once it is done everywhere, and a late rank's events wait for a later step. Fields that must
be agreed by MAX (e.g. "a read failed somewhere") ride in the same MIN as their negation.

Two checks ride in the same collective, as (x, -x) pairs: after MIN, min(x) == -min(-x) iff every
rank sent the same x. The pairs carry the step number (ranks must be at the same step) and, in
live mode, the rank's rolling decision digest (63 bits, so -d fits an int64). Only after a
mismatch is seen does a second, rare all_gather name the ranks that diverged; every rank builds
the same report from the same gathered data and raises ConsensusDivergence.

Vector layout: [min fields..., -max fields..., step, -step, (digest, -digest if live)]  # [n] int64
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kvstrata.ranks.checker import Divergence, describe_divergence
from kvstrata.ranks.decision_log import MASK63, DecisionLog


class ConsensusDivergence(RuntimeError):
    """Ranks' decision digests differ at a step; raised identically on every rank."""

    is_report = True  # the message is the whole story: rank reports leave out the traceback

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence.text())
        self.divergence = divergence


class StepMisalignment(RuntimeError):
    """Ranks called the step collective with different step numbers (a scheduler bug)."""


@dataclass(frozen=True)
class Agreed:
    """The agreed values of one step; `new` is the rise since the previous step (for counters)."""

    step: int
    values: dict[str, int]
    new: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> int:
        return self.values[name]


class StepFields(Protocol):
    """More fields of a step's one collective, and who hears their agreed values (a P/D
    worker's gates: kvstrata.pd.ranks)."""

    min_fields: tuple[str, ...]  # agreed by MIN
    max_fields: tuple[str, ...]  # agreed by MAX

    def local(self) -> dict[str, int]:
        """This rank's value of every field, before the step's collective."""
        ...

    def agreed(self, values: dict[str, int]) -> None:
        """Every rank's agreed values (of these fields and the rest) after it."""
        ...


class StepConsensus:
    """One all_reduce(MIN) per step over named int64 counts (+ step and digest checks)."""

    def __init__(
        self,
        fields: Sequence[str],
        max_fields: Sequence[str] = (),
        group: Any = None,
        live_check: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        names = list(fields) + list(max_fields)
        if not names:
            raise ValueError("fields must name at least one count")
        if len(set(names)) != len(names):
            raise ValueError(f"fields and max_fields must be distinct names, got {names}")
        self.min_fields = tuple(fields)
        self.max_fields = tuple(max_fields)
        self.group = group
        self.live_check = live_check
        self.device = torch.device(device)
        self.steps = 0
        self.collectives = 0  # on the normal path: exactly one per step
        self.rare_collectives = 0  # only after a mismatch (naming the diverged ranks)
        self._previous: dict[str, int] = dict.fromkeys(names, 0)

    @property
    def collectives_per_step(self) -> float:
        return self.collectives / self.steps if self.steps else 0.0

    def _vector(self, step: int, counts: Mapping[str, int], digest: int | None) -> torch.Tensor:
        unknown = set(counts) - set(self._previous)
        if unknown:
            raise ValueError(
                f"unknown consensus fields {sorted(unknown)}; known: {list(self._previous)}"
            )
        try:
            values = [int(counts[f]) for f in self.min_fields]
            values += [-int(counts[f]) for f in self.max_fields]
        except KeyError as exc:
            raise ValueError(f"consensus count {exc.args[0]!r} is missing") from None
        values += [step, -step]
        if self.live_check:
            if digest is None:
                raise ValueError("live consensus check needs the step's decision digest")
            d = digest & MASK63
            values += [d, -d]
        return torch.tensor(values, dtype=torch.int64, device=self.device)  # [n]

    def agree(self, step: int, counts: Mapping[str, int], log: DecisionLog | None = None) -> Agreed:
        """The one collective of `step`.

        In live mode `log` is required: its digest through the last ended step rides along, and
        on a mismatch every rank raises ConsensusDivergence naming that step (the step whose
        decisions differ) and the ranks that diverged.
        """
        digest = None
        if self.live_check:
            if log is None:
                raise ValueError("live consensus check needs the rank's DecisionLog")
            digest = log.ended_digest
        vec = self._vector(step, counts, digest)
        dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        self.steps += 1
        out = vec.tolist()
        n_min, n_max = len(self.min_fields), len(self.max_fields)
        base = n_min + n_max
        if out[base] != -out[base + 1]:
            raise StepMisalignment(
                f"ranks are at different steps: this rank at {step}, "
                f"range [{out[base]}, {-out[base + 1]}]"
            )
        if log is not None and self.live_check and out[base + 2] != -out[base + 3]:
            raise ConsensusDivergence(self._name_divergence(log))
        values = dict(zip(self.min_fields, out[:n_min], strict=True))
        values.update(zip(self.max_fields, (-v for v in out[n_min:base]), strict=True))
        new = {k: v - self._previous[k] for k, v in values.items()}
        self._previous = values
        return Agreed(step, values, new)

    def _name_divergence(self, log: DecisionLog) -> Divergence:
        """Rare path: gather every rank's digest and last step's decisions (one all_gather_object)
        so that all ranks build the same report and name the same ranks."""
        world = dist.get_world_size(self.group)
        mine = (log.ended_digest, log.last_step_records())
        objs: list[Any] = [None] * world
        dist.all_gather_object(objs, mine, group=self.group)
        self.rare_collectives += 1
        ranks = _global_ranks(self.group, world)
        digests = {ranks[i]: int(objs[i][0]) for i in range(world)}
        records = {ranks[i]: objs[i][1] for i in range(world)}
        return describe_divergence(log.step - 1, digests, records)


def _global_ranks(group: Any, world: int) -> list[int]:
    """Global rank of each member of `group`, in group order."""
    if group is None:
        return list(range(world))
    return list(dist.get_process_group_ranks(group))

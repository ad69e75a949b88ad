"""Why a locally spawned rank failed, and the parent's side of watching ranks: one report per
rank (result, error, death, hang), the rank to blame first, and reaping every process.

Kinds of report, in blame order: died, report (a divergence), raised (an error, traceback
kept), hung, lost (its peers went away: a consequence, never the cause).
"""

from __future__ import annotations

import queue as queue_mod
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


class RankFailure(RuntimeError):
    """A spawned rank raised, died or hung; the message names the rank and why, one line per
    failed rank. `traces` holds the tracebacks of ranks that raised a real error (a bug)."""

    def __init__(self, message: str, traces: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.traces = traces or {}


@dataclass(frozen=True)
class RankReport:
    """Why one rank failed. kind: report (a divergence), raised (an error, traceback kept),
    lost (its peers went away: a consequence, never the cause), died, hung."""

    kind: str
    line: str
    trace: str = ""


_BLAME_ORDER = ("died", "report", "raised", "hung", "lost")
_COMM_HINTS = ("gloo", "connection closed", "connection reset", "timed out", "broken pipe")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    if line.startswith("[") and "] " in line:  # gloo's "[../third_party/gloo/...cc:534] msg"
        line = line.split("] ", 1)[1]
    return line


def describe_exception(exc: BaseException, timeout_s: float) -> RankReport:
    """One line for what a rank hit; the traceback only for a real error. timeout_s: how long a
    collective waits (named in the message of a timed-out one)."""
    if getattr(exc, "is_report", False):
        return RankReport("report", str(exc))
    if isinstance(exc, KeyboardInterrupt):
        return RankReport("lost", "stopped by a signal")
    dist_error = getattr(dist, "DistError", ())
    line = _first_line(exc)
    if isinstance(exc, dist_error) or (
        isinstance(exc, RuntimeError) and any(h in line.lower() for h in _COMM_HINTS)
    ):
        line = line.split(". ")[0]  # gloo appends a paragraph of hints
        if "timed out" in line.lower() or "timeout" in line.lower():
            return RankReport("lost", f"no answer from a peer within {timeout_s:g} s ({line})")
        return RankReport("lost", f"lost its peers ({line})")
    return RankReport("raised", f"{type(exc).__name__}: {line}", traceback.format_exc())


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"died (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"died (killed by signal {-code})"
    return f"died (exit code {code}) without a result"


def collect_reports(
    procs: list[Any], q: Any, deadline: float, beats: Any, hang_s: float, grace: float
) -> dict[int, tuple[bool, Any]]:
    """Gather one report per rank. Once any rank has failed or exited without a report, the
    rest get a short grace (they may be stuck in a collective with it), then count as hung; a
    rank whose heartbeat is older than hang_s counts as hung too."""
    reports: dict[int, tuple[bool, Any]] = {}
    while len(reports) < len(procs):
        try:
            rank, ok, value = q.get(timeout=0.1)
            reports[rank] = (ok, value)
            if not ok:
                deadline = min(deadline, time.monotonic() + grace)
            continue
        except queue_mod.Empty:
            pass
        now = time.monotonic()
        if any(r not in reports and p.exitcode is not None for r, p in enumerate(procs)):
            # A report may still be in the pipe just after an exit: the grace covers that.
            deadline = min(deadline, now + grace)
        silent = [r for r in range(len(procs)) if r not in reports and 0 < beats[r] < now - hang_s]
        if silent:
            deadline = min(deadline, now)
        if now >= deadline:
            for rank, p in enumerate(procs):
                if p.exitcode is not None:
                    report = RankReport("died", _exit_reason(p.exitcode))
                elif beats[rank]:
                    quiet = now - beats[rank]
                    report = RankReport("hung", f"no answer for {quiet:.0f} s (hung)")
                else:
                    report = RankReport("hung", "did not finish before the timeout (hung)")
                reports.setdefault(rank, (False, report))
    return reports


def first_failure(reports: dict[int, tuple[bool, Any]]) -> RankFailure | None:
    """The rank to blame first (died, then diverged or raised, then hung; ranks that only lost
    their peers last), then one line per other failed rank."""
    failed = {r: v for r, (ok, v) in sorted(reports.items()) if not ok}
    if not failed:
        return None
    order = sorted(failed, key=lambda r: (_BLAME_ORDER.index(failed[r].kind), r))
    lines, seen = [], set()
    for r in order:
        rep = failed[r]
        if rep.kind == "report" and rep.line in seen:
            continue  # every rank raises the same divergence report: once is enough
        seen.add(rep.line)
        if rep.kind == "report":  # the report names the ranks itself, the same on every rank
            lines.append(rep.line)
        else:
            lines.append(f"rank {r} {'failed' if rep.kind != 'lost' else 'stopped'}: {rep.line}")
    if all(v.kind == "lost" for v in failed.values()):
        lines.insert(
            0, "no rank failed by itself: every rank gave up waiting on a peer (ranks out of step)"
        )
    traces = {r: v.trace for r, v in failed.items() if v.trace}
    return RankFailure("\n".join(lines), traces)


def reap(procs: list[Any], patient: bool) -> None:
    """Join every rank; never leave one behind. After a failure the survivors are only stuck
    waiting (or stopped): they are terminated at once and killed if still there after 0.5 s."""
    if not patient:
        for p in procs:
            if p.is_alive():
                p.terminate()
    end = time.monotonic() + (5.0 if patient else 0.5)
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()

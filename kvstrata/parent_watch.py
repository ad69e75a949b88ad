"""Processes that must not outlive the process that started them.

A child started by `kvstrata run`, a benchmark or a server (P/D workers, the router, spawned
ranks) holds memory, ports and transfer endpoints. If its parent dies without stopping it
(`kill -9`), nobody else will: a watcher thread notices the parent is gone (the child is
re-parented, so `os.getppid()` changes) and stops the child the way a SIGTERM does.
"""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_POLL_S = 0.5
"""How often a watched child checks that the process that started it is still there."""


def exit_with_parent(parent: int, grace_s: float) -> None:
    """Start a daemon thread: once `parent` is no longer this process's parent, send ourselves
    SIGTERM (a graceful stop: temp files removed, streams ended), and `grace_s` later end the
    process outright (still here: blocked, e.g. in a collective with ranks that are gone too).
    ValueError if `parent` is not our parent now (a wrong pid would stop us at once)."""
    if os.getppid() != parent:
        raise ValueError(f"parent pid {parent} is not this process's parent ({os.getppid()})")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="kvstrata-parent-watch", daemon=True).start()

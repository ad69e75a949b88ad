"""Listener threads: the loops that serve a socket a peer writes to (P/D transfer, KV event
replay). No message kills one; one that dies anyway is known at once.

A listener's loop runs under `Listeners.start`: `step` is called until the stop event is set.
What one message does wrong (a malformed field, a handler's bug) is caught inside the step
and reported with `failed` (counted per listener in `kvstrata:listener_message_failures`, one
line on stderr) and the loop serves the next message. Anything that escapes a step (the socket
itself failing) ends the thread: `dead` names it and every `on_death` callback runs; a server
registers one that takes /health to 503 and stops the process (kvstrata/serve/server.py).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter


class ListenerKilled(RuntimeError):
    """Raised in a listener's thread by `kill` (debug endpoints: a test's way to kill one)."""


class Listeners:
    """One process's listener threads: their per-message failures and the first death."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.counts: dict[str, int] = {}  # listener name -> messages that failed
        self.counter = (
            Counter(
                "kvstrata:listener_message_failures",
                "messages a listener thread failed to handle (it kept serving)",
                ["listener"],
                registry=registry,
            )
            if registry is not None
            else None
        )
        self.dead: str | None = None  # "<name>: <error>" of the first listener that died
        self.on_death: list[Callable[[str], None]] = []
        self._killed: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, name: str, exc: BaseException) -> None:
        """One message of listener `name` failed; the listener goes on."""
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + 1
        if self.counter is not None:
            self.counter.labels(name).inc()
        print(f"kvstrata {name}: a message failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    def start(
        self,
        name: str,
        step: Callable[[], None],
        stop: threading.Event,
        finish: Callable[[], None] | None = None,
    ) -> threading.Thread:
        """A daemon thread calling `step` until `stop` is set, then `finish` (if any)."""

        def main() -> None:
            try:
                while not stop.is_set():
                    if name in self._killed:
                        raise ListenerKilled(f"killed on request (/debug/listeners/{name}/kill)")
                    step()
                if finish is not None:
                    finish()
            except BaseException as exc:  # noqa: BLE001 - a dead listener is reported, not lost
                self._died(name, exc)

        thread = threading.Thread(target=main, name=name, daemon=True)
        thread.start()
        return thread

    def kill(self, name: str) -> None:
        """Make listener `name` die at its next step (a test's fault; debug endpoints only)."""
        self._killed.add(name)

    def _died(self, name: str, exc: BaseException) -> None:
        traceback.print_exception(exc, file=sys.stderr)
        why = f"{name}: {type(exc).__name__}: {exc}"
        with self._lock:
            first, self.dead = self.dead is None, self.dead or why
        print(f"kvstrata: listener thread {why} died; stopping", file=sys.stderr, flush=True)
        if first:
            for callback in self.on_death:
                callback(why)


def exit_process(why: str) -> None:
    """on_death of a process with no server to stop (a rank): out at once, exit 1; the server
    above it sees its rank die (serve/ranks.py) and stops in turn."""
    print(f"kvstrata: exiting, listener thread {why} died", file=sys.stderr, flush=True)
    os._exit(1)

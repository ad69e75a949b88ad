"""Temp files of the file store: who wrote them, and whether that writer can still be alive.

A temp name carries the writer's host tag and pid (see kvstrata.storage.file_store). On this host
a dead pid proves the temp an orphan; another host's pids cannot be checked, so its temps are
orphans only once older than the age limit.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

import xxhash


def host_tag() -> str:
    """8 hex digits naming this host in temp file names (hostnames may hold dots)."""
    return f"{xxhash.xxh32_intdigest(socket.gethostname().encode()):08x}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def orphan_tmp(name: str, mtime_ns: int, host: str, stale_before_ns: int) -> bool:
    """Whether temp file `name` belongs to no live writer (see the module docstring)."""
    parts = name.split(".")  # ['', <32 hex>, 'kvp', host, pid, thread, seq, 'tmp']
    if len(parts) == 8 and parts[3] == host and parts[4].isdigit():
        return not _pid_alive(int(parts[4])) or mtime_ns < stale_before_ns
    return mtime_ns < stale_before_ns  # another host (or an older name format): by age only


class TempFiles:
    """The temp files one store object of this process is writing: names them, knows which are
    open (never an orphan, whatever the age), and hands the open ones back at close()."""

    def __init__(self, suffix: str) -> None:
        self.host = host_tag()
        self.suffix = suffix
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._open: set[str] = set()
        self._closed = False

    def new(self, path: str) -> str | None:
        """A fresh temp name next to `path`, registered as open; None once closed."""
        d, name = os.path.split(path)
        tmp = f"{d}/.{name}.{self.host}.{os.getpid()}.{threading.get_ident()}.{next(self._seq)}"
        with self._lock:
            if self._closed:
                return None
            self._open.add(tmp + self.suffix)
        return tmp + self.suffix

    def done(self, tmp: str) -> None:
        with self._lock:
            self._open.discard(tmp)

    def orphan(self, path: str, name: str, mtime_ns: int, stale_before_ns: int) -> bool:
        with self._lock:
            if path in self._open:
                return False  # being written by a thread of this process
        return orphan_tmp(name, mtime_ns, self.host, stale_before_ns)

    def close(self) -> list[str]:
        """Refuse new temps; the ones still open (their writers are being cut off)."""
        with self._lock:
            self._closed = True
            left, self._open = list(self._open), set()
        return left

"""Temp files of the file store: who wrote them, and whether that writer can still be alive.

A temp name carries the writer's host tag and pid (see kvstrata.storage.file_store). On this host
a dead pid proves the temp an orphan; another host's pids cannot be checked, so its temps are
orphans only once older than the age limit.
"""

from __future__ import annotations

import os
import socket

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

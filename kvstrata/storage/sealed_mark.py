"""The mark of a sealed store: keyless writers stay out of a store that holds sealed units.

A unit store opened with a cluster key puts one marker in its commit namespace (a fixed key any
configuration can compute, refreshed while it writes, so LRU or expiry never drops it for long).
A unit store opened without a key refuses to start where it finds the marker: it would write
plain units beside sealed ones that no keyed reader takes. (A keyed store names every unit and
marker with the key, so a plain writer could never overwrite a sealed unit anyway; the refusal
makes the misconfiguration loud instead of silently splitting the store in two.)
"""

from __future__ import annotations

import time

import numpy as np
import xxhash

from kvstrata.storage.base import StorageBackend

SEALED_MARK_KEY = xxhash.xxh3_128_intdigest(b"kvstrata-sealed-store-v1")
MARK_VALUE = b"kvstrata-sealed\x00"  # 16 bytes: a commit store's value size
REFRESH_S = 60.0


def is_sealed(commits: StorageBackend) -> bool:
    """Whether a keyed writer marked the store whose commit namespace is `commits`."""
    return commits.exists_prefix([SEALED_MARK_KEY]) == 1


def refuse_keyless(commits: StorageBackend, url: str) -> None:
    """ValueError naming the key option if the store at `url` holds sealed units."""
    if is_sealed(commits):
        raise ValueError(
            f"storage {url} holds sealed units (written with a cluster key): start with the same "
            "key (storage key_file, --storage-key-file) or use another store"
        )


class SealedMark:
    """Puts the marker at open and again every REFRESH_S of writing."""

    def __init__(self, commits: StorageBackend) -> None:
        self.commits = commits
        self._value = np.frombuffer(MARK_VALUE, np.uint8).copy()
        self._next = 0.0

    def refresh(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + REFRESH_S
            self.commits.put([SEALED_MARK_KEY], [self._value])

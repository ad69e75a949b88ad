"""Vectored page-file I/O for the file backend: whole transfers, and reads hashed as they land."""

from __future__ import annotations

import os

from kvstrata.storage.base import new_checksum

READ_CHUNK = 256 * 1024
"""Payload bytes per read call on a get: each piece is hashed right after it lands, while still in
the core's L2 cache. Measured on this 2-core VM (CPU time, 64 pages of 2 MiB from the page cache):
raw reads 27 ms, read whole then hashed 39 ms, in 256 KiB pieces 35 ms (64 KiB: 38, 1 MiB: 35)."""


def transfer_all(op: object, fd: int, bufs: list[memoryview]) -> int:
    """Loop os.readv/os.writev until every buffer is done or EOF; returns bytes moved."""
    done = 0
    while bufs:
        n = op(fd, bufs)  # type: ignore[operator]
        if n <= 0:
            break
        done += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]
    return done


def read_hashed(fd: int, header: bytearray, payload: memoryview) -> tuple[int, int]:
    """Read header then payload from `fd` in READ_CHUNK pieces, hashing each piece as it lands;
    returns (bytes read, checksum of the payload bytes read). Stops early at EOF."""
    first = payload[:READ_CHUNK]
    n = transfer_all(os.readv, fd, [memoryview(header), first])
    digest = new_checksum()
    if n < len(header) + len(first):
        return n, 0
    digest.update(first)
    readv = os.readv
    for start in range(READ_CHUNK, len(payload), READ_CHUNK):
        piece = payload[start : start + READ_CHUNK]
        got = readv(fd, [piece])  # a page-cache read is whole; a short one finishes below
        if 0 < got < len(piece):
            got += transfer_all(readv, fd, [piece[got:]])
        n += got
        if got < len(piece):
            return n, 0
        digest.update(piece)
    return n, digest.intdigest()

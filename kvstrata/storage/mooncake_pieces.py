"""Where each byte of a Mooncake multi-buffer transfer lies: a value = header | piece 0 | ...

Mooncake moves bytes only to and from memory registered with its client. A piece inside
registered memory (a host pool's page, a SealedStore's tails and landing ring) moves in place.
Any other piece (a caller's buffer, a reused unregistered scratch) moves through the value's
slot in the store's registered staging area: copied out after a get, in before a put. A piece
given again within the next batch (a get reads the next batch while this one is checked) is
staged too. The header always lies in the store's registered header area.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstrata.storage.base import HEADER_NBYTES


@dataclass
class ValueMove:
    """One value's buffers for a multi-buffer call, and its staged pieces."""

    ptrs: list[int]
    """Addresses of the header and each piece's bytes, in stored order (all registered)."""
    sizes: list[int]
    """Byte count of each entry of ptrs."""
    staged: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    """(the caller's piece, its place in the staging slot) for pieces that move through it."""

    @property
    def zero_copy(self) -> bool:
        return not self.staged

    @property
    def staged_nbytes(self) -> int:
        return sum(region.nbytes for _, region in self.staged)

    def stage_in(self) -> None:
        """Before a put: staged pieces into their slot places."""
        for piece, region in self.staged:
            region[:] = piece

    def stage_out(self) -> None:
        """After a get: staged pieces out of their slot places (the pieces must be writable)."""
        for piece, region in self.staged:
            piece[:] = region


def _bytes_of(piece: memoryview) -> np.ndarray:
    return np.frombuffer(piece, np.uint8)  # no copy; read-only where the piece is


def address_of(piece: memoryview) -> int:
    """Where `piece`'s first byte lies (a C-contiguous, non-empty buffer). A writable one is
    asked through ctypes (~0.2 us; numpy's .ctypes.data costs ~1 us, a batch asks per piece)."""
    if piece.readonly:
        return int(_bytes_of(piece).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(piece))


def plan_moves(
    pieces: Sequence[Sequence[memoryview]],
    header_ptr: Callable[[int], int],
    slot: Callable[[int], np.ndarray],
    covers: Callable[[int, int], bool],
    batch: int,
) -> list[ValueMove]:
    """The moves of a get or put of values in batches of `batch`: value i's header at
    header_ptr(i), its pieces in place where `covers(address, nbytes)`, else at their offset in
    slot(i). A piece given to several values moves in place only if their batches are at least
    two apart: a get reads batch b + 1 while batch b is checked, and starts batch b + 2 only
    after, so bytes of batch b + 2 may land where batch b's were; closer, it is staged."""
    addrs = [[(address_of(p), p) for p in value if p.nbytes] for value in pieces]
    shared = _shared_within(addrs, batch)
    moves = []
    for i, value in enumerate(addrs):
        move = ValueMove([header_ptr(i)], [HEADER_NBYTES])
        at = HEADER_NBYTES
        for addr, p in value:
            n = p.nbytes
            if addr not in shared and covers(addr, n):
                move.ptrs.append(addr)
            else:
                region = slot(i)[at : at + n]
                move.ptrs.append(region.ctypes.data)
                move.staged.append((_bytes_of(p), region))
            move.sizes.append(n)
            at += n
        moves.append(move)
    return moves


def _shared_within(addrs: Sequence[Sequence[tuple[int, memoryview]]], batch: int) -> set[int]:
    """Addresses given to two values whose batches are less than two apart (or twice to one)."""
    last: dict[int, int] = {}
    shared: set[int] = set()
    for i, value in enumerate(addrs):
        b = i // batch
        for addr, _ in value:
            if addr in last and b - last[addr] < 2:
                shared.add(addr)
            last[addr] = b
    return shared

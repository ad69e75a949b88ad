"""Where each byte of a Mooncake multi-buffer transfer lies: a value = header | piece 0 | ...

Mooncake moves bytes only to and from memory registered with its client. A piece inside
registered memory (a host pool's page, a SealedStore's tails and landing ring) moves in place.
Any other piece (a caller's buffer, a reused unregistered scratch) moves through the value's
slot in the store's registered staging area: copied out after a get, in before a put. A piece
given again in the same or the next batch (a get reads the next batch while this one is
checked) is staged too. The header always lies in the store's registered header area.
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


class MovePlanner:
    """Plans the moves of one get or put, a batch at a time in order (a get plans batch b + 1
    while batch b is read): value i's header at header_ptr(i), each piece in place where
    `covers(address, nbytes)`, else at its offset in slot(i). A piece given to an earlier value
    of the same or the batch before moves through the slot too: a get checks batch b (reading
    its pieces, copying its staged ones out into them) while batch b + 1 lands, and starts
    batch b + 2 only after, so bytes of batch b + 2 may land in place where batch b's were."""

    def __init__(
        self,
        header_ptr: Callable[[int], int],
        slot: Callable[[int], np.ndarray],
        covers: Callable[[int, int], bool],
        batch: int,
    ) -> None:
        self.header_ptr, self.slot, self.covers, self.batch = header_ptr, slot, covers, batch
        self._last: dict[int, int] = {}  # address -> batch of the last value given it

    def plan(self, pieces: Sequence[Sequence[memoryview]], first: int) -> list[ValueMove]:
        """Moves of values first, first + 1, ... (after every value before `first`)."""
        return [self._move(first + j, value) for j, value in enumerate(pieces)]

    def _move(self, i: int, value: Sequence[memoryview]) -> ValueMove:
        move = ValueMove([self.header_ptr(i)], [HEADER_NBYTES])
        b, at = i // self.batch, HEADER_NBYTES
        for p in value:
            n = p.nbytes
            if not n:
                continue
            addr = address_of(p)
            seen = self._last.get(addr)
            self._last[addr] = b
            if (seen is None or b - seen >= 2) and self.covers(addr, n):
                move.ptrs.append(addr)
            else:
                region = self.slot(i)[at : at + n]
                move.ptrs.append(region.ctypes.data)
                move.staged.append((_bytes_of(p), region))
            move.sizes.append(n)
            at += n
        return move

"""Where each byte of a Mooncake multi-buffer transfer lies: a value = header | piece 0 | ...

Mooncake moves bytes only to and from memory registered with its client. A piece inside
registered memory (a host pool's page) moves in place. Any other piece (a caller's buffer, a
seal's 44-byte tail, a reused scratch) moves through the value's slot in the store's registered
staging area: copied out after a get, in before a put. A piece given to several values of one
batch (a scratch reused value after value) is always staged, since one call moves every value
of the batch at once. The header always lies in the store's registered header area.
"""

from __future__ import annotations

from collections import Counter
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


def plan_moves(
    pieces: Sequence[Sequence[memoryview]],
    header_ptr: Callable[[int], int],
    slot: Callable[[int], np.ndarray],
    covers: Callable[[int, int], bool],
) -> list[ValueMove]:
    """The moves of a batch: value i's header at header_ptr(i), its pieces in place where
    `covers(address, nbytes)` and not shared in the batch, else at their offset in slot(i)."""
    arrays = [[_bytes_of(p) for p in value if p.nbytes] for value in pieces]
    uses = Counter(a.ctypes.data for value in arrays for a in value)
    moves = []
    for i, value in enumerate(arrays):
        move = ValueMove([header_ptr(i)], [HEADER_NBYTES])
        at = HEADER_NBYTES
        for a in value:
            addr = a.ctypes.data
            if uses[addr] == 1 and covers(addr, a.nbytes):
                move.ptrs.append(addr)
            else:
                region = slot(i)[at : at + a.nbytes]
                move.ptrs.append(region.ctypes.data)
                move.staged.append((a, region))
            move.sizes.append(a.nbytes)
            at += a.nbytes
        moves.append(move)
    return moves

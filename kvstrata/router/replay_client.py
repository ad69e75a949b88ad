"""One replay request to a replica's replay socket, read whole or known to have failed.

The replica's answer to [start seq] is one message per buffered batch from that number on, then
an end marker (kvstrata.cache.event_wire.END_SEQ). A kvstrata replica stops an answer its reader's
queue cannot take and sends no end marker after it (kvstrata/serve/event_replay.py), so an answer
is whole exactly when its end marker comes. Read here: the batches as they come, then
- no message within `wait_s` (the answer was cut, or the replica is gone): TimeoutError;
- a batch that is not the one after the last (a publisher that drops what its queue cannot take
  and still ends the answer, as a plain ROUTER does): ReplayFailed.
Either way the caller has applied a prefix of the answer, in order, and asks again from there.

Frames: our (seq, payload) and vLLM's (topic, seq, payload) alike, after the DEALER's empty
delimiter: the seq is always the next to last frame.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zmq

from kvstrata.cache.event_wire import END_SEQ


class ReplayFailed(RuntimeError):
    """A replay answer that is not a whole run of consecutive batches (the message says how)."""


@dataclass(frozen=True)
class ReplayTiming:
    """How a subscriber waits for, and asks again for, a replica's replay."""

    wait_s: float = 5.0  # longest wait for an answer's next message (its end marker included)
    first_retry_s: float = 0.5  # the pause after a failed replay, doubled per failure in a row
    max_retry_s: float = 30.0  # the longest pause between two tries
    # Messages the DEALER's queue holds before the replica's refuses more (and cuts the
    # answer): room for a whole answer of any usual --kv-events-buffer, however slowly the
    # index is updated. An answer longer than this is cut, then finished by the next tries.
    rcv_hwm: int = 100_000

    def retry_s(self, failures: int) -> float:
        """The pause before the next try, after `failures` failed tries in a row (>= 1)."""
        return min(self.max_retry_s, self.first_retry_s * 2.0 ** (failures - 1))


def replayed(
    dealer: zmq.Socket, endpoint: str, start: int, wait_s: float, halted: Callable[[], bool]
) -> Iterator[tuple[int, bytes]]:
    """Ask `dealer`'s replica for every batch from `start`; yield each (seq, payload) in order,
    returning at the end marker. Raises TimeoutError or ReplayFailed (see the module)."""
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    expected: int | None = None  # the seq that must come next (the first may be past `start`:
    # the replica's buffer no longer holds what came before it)
    while not halted():
        if not dealer.poll(int(wait_s * 1000)):
            raise TimeoutError(
                f"replay socket {endpoint} sent nothing for {wait_s:g} s before its end marker "
                f"(the answer from {start} was cut, or the replica is gone)"
            )
        frames = dealer.recv_multipart()
        if len(frames) < 3 or len(frames[-2]) != 8:
            raise ReplayFailed(f"replay socket {endpoint}: {len(frames)} frames, not a batch")
        if frames[-2] == END_SEQ:
            return
        seq = int.from_bytes(frames[-2], "big")
        due = start if expected is None else expected
        if seq < start or (expected is not None and seq != expected):
            raise ReplayFailed(
                f"replay socket {endpoint} sent batch {seq} where {due} was due "
                "(batches of the answer were dropped)"
            )
        expected = seq + 1
        yield seq, frames[-1]
    raise ReplayFailed(f"replay from {endpoint} stopped before its end marker (subscriber stop)")

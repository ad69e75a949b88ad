"""The one rule for memory a pool takes: it must fit in what the machine has available now.

Every entry point (kvstrata run / replay / serve, the vLLM connector's workers) asks before it
allocates a pool, so an oversized pool is one line naming its option and the bytes, never a
process killed by the kernel half-way through start-up.
"""

from __future__ import annotations

from collections.abc import Sequence

import psutil


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_fits(parts: Sequence[tuple[str, int]], what: str = "") -> None:
    """ValueError naming the biggest part when the pools (label, bytes) together would not fit
    in the memory available now (psutil's figure: free plus reclaimable)."""
    need = sum(n for _, n in parts)
    avail = psutil.virtual_memory().available
    if need <= avail:
        return
    biggest = max(parts, key=lambda p: p[1])
    detail = ", ".join(f"{label} {gb(n)}" for label, n in parts if n)
    raise ValueError(
        f"{biggest[0]}: {what}needs {gb(need)} ({need:,} bytes: {detail}) but the machine has "
        f"{gb(avail)} ({avail:,} bytes) available"
    )

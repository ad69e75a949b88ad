"""Hand-off messages between a decode and a prefill worker (what crosses the transport).

A message is a list of frames: frame 0 a msgpack header (a dict with "type" and the hand-off
"id"), then raw payload frames. Decode -> prefill: `handoff` (prompt, cache_salt, the keys of the
pages decode holds, decode's layout), `cancel` and `pulled` (below). Prefill -> decode: `pull`
(below), `heartbeat` while it computes, `refused` (the reason, one line), or `pages`: one frame
per page decode lacks (the host page layout [layers, 2, page_size, kv_heads, head_dim],
page_bytes each: the draft's tail layers too when speculating, so target and draft parts of a
page cross as one frame with one checksum), then the first-token logits row, then (an MTP head
only) the speculator's state: the target's hidden state at the last prompt token. Every frame
carries an xxh3-64 checksum in the header; a hand-off is all or nothing: one bad frame and none
of its pages is used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

Frames = list[Any]  # bytes-like frames (bytes, memoryview, numpy buffers)
KEY_BYTES = 16  # page keys are 128-bit; msgpack ints stop at 64 bits
U64 = (1 << 64) - 1
MAX_ID = 256  # longest `type` / `id` of a header (an id is a request id, plus "~attempt")


class WireError(Exception):
    """A malformed, inconsistent or corrupted message (the hand-off fails; nothing is used)."""


@dataclass(frozen=True)
class Layout:
    """What must be equal on both workers for a page to mean the same thing on each."""

    page_size: int
    dtype: str
    model: str  # the target model's fingerprint (its weights)
    draft: str  # the speculator's fingerprint ("draft:<fp>", "mtp+state:<fp>"; "" when off)
    layers: int  # the target's layers + the draft's tail layers
    kv_heads: int
    head_dim: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    page_bytes: int = 0  # the whole page (every rank's part together)
    rank: int = 0  # this worker's rank that speaks: rank r talks to rank r of the other worker

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def layout_mismatch(mine: Layout, theirs: Any, theirs_name: str) -> str | None:
    """None when `theirs` matches `mine`; else a sentence naming the first differing field (or
    saying `theirs` is no layout at all: whatever a peer sent, this never raises)."""
    if not isinstance(theirs, dict):
        return f"layout from {theirs_name} is a {type(theirs).__name__}, not a map"
    for field, value in mine.as_dict().items():
        other = theirs.get(field)
        if type(other) is not type(value) or other != value:  # 1 == True == 1.0: types first
            return f"layout mismatch: {field} is {value!r} here but {other!r} on {theirs_name}"
    return None


def typed(head: dict[str, Any], name: str, kind: type, lo: int = 0, hi: int = 1 << 62) -> Any:
    """head[name] if it is a `kind` (an int in [lo, hi]; bool is no int), else WireError naming
    the field: every field of a peer's message is checked by type and range before use."""
    value = head.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        got = type(value).__name__ if name in head else "nothing"
        raise WireError(
            f"{head.get('type')!s:.20} field {name!r}: expected {kind.__name__}, got {got}"
        )
    if kind is int and not lo <= value <= hi:
        raise WireError(f"{head.get('type')!s:.20} field {name!r}: {value} is outside [{lo}, {hi}]")
    return value


def int_list(head: dict[str, Any], name: str, lo: int = 0, hi: int = 1 << 62) -> list[int]:
    """head[name] as a list of ints in [lo, hi] (checked like `typed`)."""
    values = typed(head, name, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi for v in values):
        raise WireError(
            f"{head.get('type')!s:.20} field {name!r}: not a list of ints in [{lo}, {hi}]"
        )
    return values


def checksum(page: Any) -> int:
    """xxh3-64 of one frame's bytes."""
    return xxhash.xxh3_64_intdigest(memoryview(page).cast("B"))


def pack_keys(keys: list[int]) -> bytes:
    return b"".join(k.to_bytes(KEY_BYTES, "big") for k in keys)


def unpack_keys(blob: bytes) -> list[int]:
    if len(blob) % KEY_BYTES:
        raise WireError(f"key blob of {len(blob)} bytes is not a multiple of {KEY_BYTES}")
    return [int.from_bytes(blob[i : i + KEY_BYTES], "big") for i in range(0, len(blob), KEY_BYTES)]


def header(kind: str, hid: str, **fields: Any) -> bytes:
    return msgpack.packb({"type": kind, "id": hid, **fields})


def read_header(frames: Frames) -> dict[str, Any]:
    if not frames:
        raise WireError("empty message")
    try:
        head = msgpack.unpackb(bytes(frames[0]))
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"header is not msgpack: {exc}") from None
    if not isinstance(head, dict):
        raise WireError("header is not a map")
    for name in ("type", "id"):
        value = head.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_ID:
            raise WireError(f"header field {name!r}: expected a string of 1 to {MAX_ID} chars")
    return head


def pages_message(
    hid: str,
    first_page: int,
    pages: list[Any],
    logits: np.ndarray,
    state: np.ndarray | None = None,
    **stats: Any,
) -> Frames:
    """`pages` reply: header + one frame per page (sent as they are, no copy) + the logits row
    (+ the speculator's state, float32, when there is one)."""
    row = np.ascontiguousarray(logits, dtype=np.float32)
    extra: dict[str, Any] = {}
    tail = [row]
    if state is not None:
        st = np.ascontiguousarray(state, dtype=np.float32)
        extra = {"state_checksum": checksum(st), "state_shape": list(st.shape)}
        tail.append(st)
    head = header(
        "pages",
        hid,
        first_page=first_page,
        page_bytes=[memoryview(p).nbytes for p in pages],
        checksums=[checksum(p) for p in pages],
        logits_checksum=checksum(row),
        vocab=int(row.shape[0]),
        **extra,
        **stats,
    )
    return [head, *pages, *tail]


@dataclass(frozen=True)
class Received:
    """A verified `pages` reply: pages [first_page, first_page + len(pages)) and the logits row."""

    first_page: int
    pages: list[memoryview]
    logits: np.ndarray  # [vocab] float32
    stats: dict[str, Any]
    state: np.ndarray | None = None  # the speculator's state (MTP: [1, hidden] float32)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pages)


def read_pages(
    head: dict[str, Any], frames: Frames, page_bytes: int, want_state: bool = False
) -> Received:
    """Check every frame (count, size, checksum) before any is used: all or nothing.
    `want_state`: the reply must carry the speculator's state (decode runs an MTP head)."""
    sums, sizes = int_list(head, "checksums", 0, U64), int_list(head, "page_bytes")
    if len(sums) != len(sizes):
        raise WireError("pages header lacks matching checksums/page_bytes lists")
    first, vocab = typed(head, "first_page", int), typed(head, "vocab", int, 1, 1 << 32)
    has_state = "state_shape" in head
    if want_state and not has_state:
        raise WireError("the reply lacks the MTP head's hidden state (prefill's state frame)")
    if len(frames) != 2 + len(sums) + has_state:
        raise WireError(f"expected {2 + len(sums) + has_state} frames, got {len(frames)}")
    pages = [memoryview(f).cast("B") for f in frames[1 : 1 + len(sums)]]
    for i, (page, size, want) in enumerate(zip(pages, sizes, sums, strict=True)):
        if size != page_bytes or page.nbytes != page_bytes:
            raise WireError(f"page {i}: {page.nbytes} bytes, expected {page_bytes}")
        if checksum(page) != want:
            raise WireError(f"page {i} (prompt page {first + i}) failed its checksum")
    row = memoryview(frames[1 + len(sums)]).cast("B")
    if checksum(row) != head.get("logits_checksum") or row.nbytes != 4 * vocab:
        raise WireError("the logits row failed its checksum or size")
    logits = np.frombuffer(row, dtype=np.float32).copy()
    state = _read_state(head, frames[-1]) if has_state else None
    skip = ("type", "id", "checksums", "page_bytes", "logits_checksum", "first_page")
    skip += ("state_checksum", "state_shape")
    stats = {k: v for k, v in head.items() if k not in skip}
    return Received(first, pages, logits, stats, state)


def _read_state(head: dict[str, Any], frame: Any) -> np.ndarray:
    """The speculator's state frame, checked against its checksum and shape."""
    raw = memoryview(frame).cast("B")
    shape = int_list(head, "state_shape", 1, 1 << 32)
    if checksum(raw) != head.get("state_checksum") or raw.nbytes != 4 * int(np.prod(shape)):
        raise WireError("the speculator's state failed its checksum or size")
    return np.frombuffer(raw, dtype=np.float32).reshape(shape).copy()


# ---- layer by layer ----------------------------------------------------------------------------
# A layered hand-off sends one `layer` message per model layer as soon as that layer is computed:
# one frame per page, that page's slice [2, page_size, kv_heads, head_dim] of the layer (each
# checksummed), then a `pages` message with no page frames and `layers` set, and the logits row.


def layer_message(hid: str, layer: int, first_page: int, pages: list[Any]) -> Frames:
    sums = [checksum(p) for p in pages]
    return [header("layer", hid, layer=layer, first_page=first_page, checksums=sums), *pages]


def read_layer(head: dict[str, Any], frames: Frames, layer_bytes: int) -> list[memoryview]:
    """One layer's page slices, each checked (size, checksum) before any is kept."""
    sums = int_list(head, "checksums", 0, U64)
    if len(frames) != 1 + len(sums):
        raise WireError(f"layer message: {len(frames) - 1} page frames for {len(sums)} checksums")
    out = [memoryview(f).cast("B") for f in frames[1:]]
    for i, (part, want) in enumerate(zip(out, sums, strict=True)):
        if part.nbytes != layer_bytes or checksum(part) != want:
            raise WireError(f"layer {head.get('layer')} of page {i} failed its size or checksum")
    return out


def assemble(layers: dict[int, list[memoryview]], n_layers: int, n_pages: int) -> list[Any]:
    """Whole host-layout pages [layers, 2, page, heads, dim] from every layer's slices."""
    if sorted(layers) != list(range(n_layers)) or any(len(v) != n_pages for v in layers.values()):
        got = {k: len(v) for k, v in sorted(layers.items())}
        raise WireError(
            f"layered hand-off incomplete: pages per layer {got}, want {n_pages} x {n_layers}"
        )
    if not n_pages:
        return []
    size = layers[0][0].nbytes
    buf = np.empty((n_pages, n_layers, size), dtype=np.uint8)
    for layer, parts in layers.items():
        for p, part in enumerate(parts):
            buf[p, layer] = np.frombuffer(part, dtype=np.uint8)
    return [memoryview(buf[p].reshape(-1)) for p in range(n_pages)]


# ---- pulls: prefill asks decode for held pages it lacks ----------------------------------------
# Prefill -> decode: `pull` (pages [first_page, end_page) of those decode said it holds). Decode ->
# prefill: `pulled`: one frame per page in the host page layout, each with its own checksum. Unlike
# a hand-off's reply a pull is not all or nothing: the leading pages that pass their checks are
# used, the first that fails and every one after it are misses that prefill computes.


def pull_message(hid: str, first_page: int, end_page: int) -> Frames:
    return [header("pull", hid, first_page=first_page, end_page=end_page)]


def pulled_message(hid: str, first_page: int, pages: list[Any]) -> Frames:
    """`pulled` reply: header + one frame per page (sent as it is, no copy)."""
    sums = [checksum(p) for p in pages]
    return [header("pulled", hid, first_page=first_page, checksums=sums), *pages]


def read_pulled(
    head: dict[str, Any], frames: Frames, page_bytes: int, first_page: int, end_page: int
) -> tuple[list[memoryview], str]:
    """The leading pulled pages of [first_page, end_page) that pass their size and checksum,
    and why the rest were dropped ("" when none was)."""
    sums = head.get("checksums")
    if head.get("first_page") != first_page or not isinstance(sums, list):
        return [], f"pulled reply starts at page {head.get('first_page')!r:.20}, asked {first_page}"
    if len(frames) != 1 + len(sums) or len(sums) > end_page - first_page:
        return [], f"pulled reply: {len(frames) - 1} frames, {len(sums)} checksums"
    good: list[memoryview] = []
    for i, (frame, want) in enumerate(zip(frames[1:], sums, strict=True)):
        page = memoryview(frame).cast("B")
        if page.nbytes != page_bytes or checksum(page) != want:
            return good, f"pulled page {first_page + i} failed its size or checksum"
        good.append(page)
    short = len(good) < end_page - first_page
    return good, f"decode sent {len(good)} of {end_page - first_page} pages" if short else ""

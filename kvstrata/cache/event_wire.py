"""KV event batches on the wire: typed events, and their two encodings (msgpack, both directions).

One message payload is an `EventBatch`, a msgpack array `[ts, [event, ...], data_parallel_rank]`.
An event is encoded in one of two formats:

vllm   (default) vLLM 0.32's schema: each event a map tagged by "type", every field by name:
         {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
          "lora_id", "medium", "lora_name", "extra_keys", "group_idx"}
         {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}
         {"type": "AllBlocksCleared"}
       `extra_keys` holds one entry per block: None, or a tuple of the block's extra hash inputs,
       untagged as vLLM publishes them; ours is `(cache_salt,)` for every block of a salted
       request (vLLM puts the salt on a chain's first block; a consumer that indexes blocks one
       by one needs it on each, and the schema allows it). Fields at vLLM's defaults that vLLM
       leaves out (its msgspec structs omit defaults) are left out too.
array  the older tagged arrays, fields in vLLM's positional order, no salt:
         ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
         ["BlockRemoved", block_hashes, medium]
         ["AllBlocksCleared"]

Block hashes are 64-bit integers (the low 64 bits of our page keys, kvstrata.cache.events).
Media: "GPU" (device pages), "CPU" (host memory), "DISK" (storage), the names Dynamo's indexer
reports as gpu, cpu and disk. `decode_batch` reads either format (each event by its own shape).

A replay socket answers a request [start seq] with one message per batch, (seq, payload), then
the end marker (END_SEQ, empty): both formats, as vLLM's replay ends. The marker is the only
proof an answer is whole (kvstrata/serve/event_replay.py); it carries nothing else, so a consumer
of vLLM's replay reads ours unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

FORMATS = ("vllm", "array")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay answer's last message's seq frame
GROUP_IDX = 0  # every page of ours is in one KV cache group (vLLM's group 0)


class EventWireError(ValueError):
    """A payload that is not an event batch of either format (the message names what is wrong)."""


@dataclass(frozen=True)
class BlockStored:
    """Consecutive pages of one chain now held on `medium`."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the page before block_hashes[0]; None at a chain's root
    token_ids: list[int]  # every page's tokens in order (empty where the publisher has none)
    block_size: int  # tokens per page
    medium: str
    salts: list[str]  # one per block: its cache_salt ("" when unsalted or not said)
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Pages no longer held on `medium`."""

    block_hashes: list[int]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """The publisher forgot every page on every medium (a prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None


# ---- encoding ------------------------------------------------------------------------------------
def encode_batch(events: Sequence[KVEvent], fmt: str, ts: float, dp_rank: int = 0) -> bytes:
    """One batch's msgpack payload in format `fmt` ("vllm" or "array")."""
    if fmt not in FORMATS:
        raise ValueError(f"KV events format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    enc = _vllm_event if fmt == "vllm" else _array_event
    return bytes(msgpack.packb([ts, [enc(e) for e in events], dp_rank]))


def _vllm_event(ev: KVEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        extra = [(s,) if s else None for s in ev.salts]
        return {
            "type": "BlockStored",
            "block_hashes": ev.block_hashes,
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": ev.token_ids,
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
            "extra_keys": extra if extra else None,
            "group_idx": GROUP_IDX,
        }
    if isinstance(ev, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": ev.block_hashes,
            "medium": ev.medium,
            "group_idx": GROUP_IDX,
        }
    return {"type": "AllBlocksCleared"}


def _array_event(ev: KVEvent) -> list[Any]:
    if isinstance(ev, BlockStored):
        return ["BlockStored", ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                ev.block_size, None, ev.medium]  # fmt: skip
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", ev.block_hashes, ev.medium]
    return ["AllBlocksCleared"]


# ---- decoding ------------------------------------------------------------------------------------
def decode_batch(payload: bytes) -> EventBatch:
    """A payload of either format as typed events; EventWireError names what is malformed."""
    try:
        raw = msgpack.unpackb(payload)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise EventWireError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise EventWireError("an event batch is [ts, [event, ...], data_parallel_rank]")
    rank = raw[2] if len(raw) == 3 else None
    try:
        events = [_decode_event(e) for e in raw[1]]
    except (TypeError, KeyError, IndexError, ValueError) as exc:
        raise EventWireError(f"bad event: {type(exc).__name__}: {exc}") from None
    return EventBatch(float(raw[0]), events, rank)


def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        return _from_map(raw)
    if isinstance(raw, list) and raw:
        return _from_array(raw)
    raise EventWireError(f"an event is a tagged map or array, got {type(raw).__name__}")


def _from_map(m: dict[str, Any]) -> KVEvent:
    kind = m["type"]
    if kind == "BlockStored":
        hashes = _hashes(m["block_hashes"])
        return BlockStored(
            hashes,
            _parent(m.get("parent_block_hash")),
            [int(t) for t in m.get("token_ids") or []],
            int(m["block_size"]),
            str(m.get("medium") or "GPU"),  # vLLM's own device events may leave it unset
            _salts(m.get("extra_keys"), len(hashes), m.get("lora_name")),
            m.get("lora_name"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(m["block_hashes"]), str(m.get("medium") or "GPU"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventWireError(f"unknown event type {kind!r}")


def _from_array(a: list[Any]) -> KVEvent:
    kind = a[0]
    if kind == "BlockStored":
        hashes = _hashes(a[1])
        medium = str(a[6]) if len(a) > 6 and a[6] else "GPU"
        return BlockStored(
            hashes, _parent(a[2]), [int(t) for t in a[3]], int(a[4]), medium, [""] * len(hashes)
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(a[1]), str(a[2]) if len(a) > 2 and a[2] else "GPU")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventWireError(f"unknown event type {kind!r}")


def _hash(h: Any) -> int:
    """A block hash as an int (vLLM may send 32-byte digests: their low 64 bits, as it does)."""
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & ((1 << 64) - 1)
    return int(h)


def _hashes(raw: Any) -> list[int]:
    return [_hash(h) for h in raw]


def _parent(raw: Any) -> int | None:
    return None if raw is None else _hash(raw)


def _salts(extra: Any, n: int, lora_name: str | None) -> list[str]:
    """Each block's cache_salt from `extra_keys`: vLLM's order is the LoRA name (when lora_name is
    set), (mm id, offset) pairs, the salt, then prompt-embeds digests (bytes): the last string that
    is not the LoRA name; "" where there is none."""
    if not extra:
        return [""] * n
    if len(extra) != n:
        raise EventWireError(f"extra_keys has {len(extra)} entries for {n} blocks")
    out = []
    for keys in extra:
        words = [k for k in keys or () if isinstance(k, str)]
        if lora_name and words and words[0] == lora_name:
            words = words[1:]
        out.append(words[-1] if words else "")
    return out

"""KV event batches on the wire (kvstrata/cache/event_wire.py) and the fleet index they feed
(kvstrata/router/index.py): exact bytes of each format, both read back, salts kept apart."""

from __future__ import annotations

import msgpack
import pytest

from kvstrata.cache.event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventWireError,
    decode_batch,
    encode_batch,
)
from kvstrata.router.index import FleetIndex, Match

EVENTS = [
    AllBlocksCleared(),
    BlockStored([11, 12], None, list(range(8)), 4, "GPU", ["t-a", "t-a"]),
    BlockStored([13], 12, [8, 9, 10, 11], 4, "DISK", [""]),
    BlockRemoved([11], "CPU"),
]


def test_vllm_format_is_vllms_tagged_maps() -> None:
    ts, events, rank = msgpack.unpackb(encode_batch(EVENTS, "vllm", 1.5))
    assert (ts, rank) == (1.5, 0)
    assert events == [
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
         "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [["t-a"], ["t-a"]], "group_idx": 0},
        {"type": "BlockStored", "block_hashes": [13], "parent_block_hash": 12,
         "token_ids": [8, 9, 10, 11], "block_size": 4, "lora_id": None, "medium": "DISK",
         "lora_name": None, "extra_keys": [None], "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU", "group_idx": 0},
    ]  # fmt: skip


def test_array_format_is_the_older_tagged_arrays() -> None:
    _, events, _ = msgpack.unpackb(encode_batch(EVENTS, "array", 1.5))
    assert events == [
        ["AllBlocksCleared"],
        ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU"],
        ["BlockStored", [13], 12, [8, 9, 10, 11], 4, None, "DISK"],
        ["BlockRemoved", [11], "CPU"],
    ]


def test_both_formats_decode_to_the_same_events() -> None:
    assert decode_batch(encode_batch(EVENTS, "vllm", 2.0)).events == EVENTS
    unsalted = [e if not isinstance(e, BlockStored) else BlockStored(
        e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium,
        [""] * len(e.block_hashes)) for e in EVENTS]  # fmt: skip
    assert decode_batch(encode_batch(EVENTS, "array", 2.0)).events == unsalted


def test_vllms_first_block_salt_and_lora_name() -> None:
    """vLLM salts a chain's first block only and puts a LoRA name first: the salt is read out."""
    raw = {"type": "BlockStored", "block_hashes": [b"\x00" * 24 + (7).to_bytes(8, "big"), 8],
           "parent_block_hash": None, "token_ids": [], "block_size": 2, "lora_id": 1,
           "medium": None, "lora_name": "ad", "extra_keys": [["ad", "salt-1"], ["ad"]]}  # fmt: skip
    (ev,) = decode_batch(msgpack.packb([0.0, [raw]])).events
    assert isinstance(ev, BlockStored)
    assert (ev.block_hashes, ev.salts, ev.medium) == ([7, 8], ["salt-1", ""], "GPU")
    with pytest.raises(EventWireError, match="unknown event type"):
        decode_batch(msgpack.packb([0.0, [{"type": "Nope"}]]))
    with pytest.raises(EventWireError, match="not msgpack"):
        decode_batch(b"\xc1")


def test_index_keys_pages_by_salt_and_shares_the_store() -> None:
    idx = FleetIndex()
    idx.add("a", "store-1")
    idx.add("b", "store-1")
    idx.add("c", "")
    stored = BlockStored([1, 2, 3], None, [], 4, "GPU", ["s", "", ""])  # vLLM's first-block salt
    idx.apply("a", decode_batch(encode_batch([stored], "vllm", 0.0)))
    assert idx.match("a", "s", [1, 2, 3]) == Match(3, 3, 3)
    assert idx.match("a", "", [1, 2, 3]) == Match(0, 0, 0)  # another tenant: nothing
    host = BlockStored([1, 2], None, [], 4, "CPU", ["s", "s"])
    disk = BlockStored([1, 2, 3, 4], None, [], 4, "DISK", ["s"] * 4)
    idx.apply("a", decode_batch(encode_batch([host, disk, BlockRemoved([1], "GPU")], "vllm", 0)))
    assert idx.match("a", "s", [1, 2, 3, 4, 5]) == Match(0, 3, 4)  # page 3 still on device
    assert idx.match("b", "s", [1, 2, 3, 4]) == Match(0, 0, 4)  # a's store is b's too
    assert idx.match("c", "s", [1, 2, 3, 4]) == Match(0, 0, 0)
    idx.drop("a")
    assert idx.match("b", "s", [1, 2, 3, 4]) == Match(0, 0, 0)
    assert idx.pages() == {"GPU": 0, "CPU": 0, "DISK": 0}

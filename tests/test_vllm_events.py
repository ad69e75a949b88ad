"""The vLLM connector's KV events: exact host ("CPU") and storage ("DISK") stores and removals.

tests/vllm_events_driver.py runs under .venv-vllm (vLLM's own request, scheduler-output and
event types) and plays vLLM's engine loop around the connector's scheduler and worker sides with
real KV tensors and a file store: request a (10 tokens: 2 full pages of 4) is stored in host
memory, then backed up; request b's 2 pages (salted: its salt in every page's extra_keys) then
push a's out of the 2 host pages.
"""

from __future__ import annotations

from pathlib import Path

from kvstrata.cache.events import block_hash
from kvstrata.cache.keys import Namespace, page_keys, salted
from tests.vllm_drivers import run_driver

DRIVER = Path(__file__).with_name("vllm_events_driver.py")


def keys(first: int, salt: str = "") -> list[int]:
    """The page keys of tokens first .. first+7 under the driver's namespace (and a salt)."""
    ns = Namespace(model_fingerprint="events-test", kv_dtype="float32", page_size=4)
    return page_keys(list(range(first, first + 8)), salted(ns, salt))


def hashes(page_keys_: list[int]) -> list[int]:
    return [block_hash(k) for k in page_keys_]


def test_host_and_storage_events_are_exact(tmp_path: Path) -> None:
    batches = run_driver(DRIVER, f"file://{tmp_path / 'storage'}")
    a, b = hashes(keys(100)), hashes(keys(200, "tenant-b"))
    a_gone = hashes(sorted(keys(100)))  # removals come in key order
    unsalted, salt_b = [None, None], [["tenant-b"], ["tenant-b"]]  # extra_keys, one per page
    assert batches == [
        [["stored", a, None, 8, "CPU", unsalted, 4]],
        [["stored", a, None, 8, "DISK", unsalted, 4]],
        [["removed", a_gone, None, 0, "CPU"]],  # b's store took a's host pages
        [["stored", b, None, 8, "CPU", salt_b, 4]],
        [["stored", b, None, 8, "DISK", salt_b, 4]],
    ]

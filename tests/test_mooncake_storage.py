"""Engines over a real Mooncake Store as storage: a fresh engine hits what another backed up, and a
master killed (kill -9) mid-run and restarted changes no output (only hits; the counters show
the failures).

Mooncake keeps an object in the memory segment of a live client: a standalone mooncake_client
holds the segment (a node's long-lived memory); the engines' clients contribute none, so what
they wrote outlives them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.bench.local_mooncake import MooncakeMaster
from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from tests.mooncake_server import fast, held_store
from tests.test_engine_cache import CKPT, PAGE, assert_same, conversation, model, run_turns

pytestmark = pytest.mark.slow  # a mooncake_master, a segment holder and engines
# the engine cache tests' checkpoint (conftest's ckpt builds it) and model fixture
__all__ = ["CKPT", "model"]
LENIENT = fast(require_reachable_at_start=False)


@pytest.fixture
def mc() -> Iterator[tuple[MooncakeMaster, str]]:
    """A master, a segment holder and the URL the engines use (no segment of their own)."""
    with held_store() as (m, url):
        yield m, url


def turns_with(
    model,  # noqa: ANN001
    url: str,
    prompts: list[list[int]],
    between: Callable[[int, Any], None] = lambda turn, storage: None,
) -> tuple[list[Request], dict[str, int | float]]:
    """run_turns' loop over mooncake, calling between(k, the engine's storage) after turn k;
    requests + storage stats."""
    cfg = CacheConfig(
        page_size=PAGE, device_pages=64, host_pages=64, storage_url=url,
        prefetch_policy="wait_complete",
    )  # fmt: skip
    built = build_engine(EngineConfig(max_batch_tokens=1024), cfg, LENIENT, model=model)
    eng, results = built.engine, []
    storage = built.engine.cache.mover.storage if built.engine.cache else None  # type: ignore[union-attr]
    for k, prompt in enumerate(prompts):
        req = Request(f"t{k}", prompt, max_new_tokens=4, keep_logits=True)
        eng.submit(req)
        while eng.has_work():
            eng.step()
            eng.check_integrity()
        eng.drain()
        eng.check_integrity()
        results.append(req)
        between(k, storage)
    stats = storage.stats() if storage is not None else {}
    built.close()
    return results, stats


def test_a_fresh_engine_hits_what_another_backed_up(model, mc, tmp_path: Path) -> None:  # noqa: ANN001, F811
    _, url = mc
    prompts = conversation(3, seed=31)
    ref = run_turns(model, "none", tmp_path / "unused", prompts)
    first, st = turns_with(model, url, prompts)
    assert st["put_skipped"] == 0 and st["puts"] > 0 and st["corrupt"] == 0
    second, _ = turns_with(model, url, prompts)
    assert_same(ref, first)
    assert_same(ref, second)
    assert second[0].hits == {"device": 0, "host": 0, "storage": (len(prompts[0]) - 1) // PAGE}


def rejoined(storage: Any, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until the engine's client answers the restarted master again."""
    deadline = time.monotonic() + timeout_s
    while storage.stats()["reconnects"] == 0:
        assert time.monotonic() < deadline, (
            f"the client did not re-join the restarted master in {timeout_s} s: {storage.stats()}"
        )
        storage.exists_prefix([1])  # a call: after the backoff it tries the master again
        time.sleep(0.2)


def test_master_killed_mid_run_and_restarted_changes_no_output(model, mc, tmp_path: Path) -> None:  # noqa: ANN001, F811
    m, url = mc
    prompts = conversation(6, seed=32)
    ref = run_turns(model, "none", tmp_path / "unused", prompts)

    def between(turn: int, storage: Any) -> None:
        if turn == 1:
            m.kill()  # kill -9: the master and every object it placed are gone
        if turn == 3:
            m.start()  # same ports, empty; the clients re-join by themselves
            rejoined(storage)  # before the next turns (the wheel's own reconnect takes seconds)

    got, st = turns_with(model, url, prompts, between)
    assert_same(ref, got)
    assert st["connection_errors"] >= 1 and st["put_skipped"] > 0, st
    assert st["reconnects"] >= 1 and st["corrupt"] == 0, st
    again, _ = turns_with(model, url, prompts)  # after the restart: a fresh engine, same output
    assert_same(ref, again)

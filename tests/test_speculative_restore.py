"""The draft's KV is restored with the target's: after a hit from device, host (forced demotion) or
storage (a fresh process on the same store), every restored page's bytes, draft tail layers
included, equal those the cold run cached, and each request's acceptance sequence equals a cold
run's.

For an MTP head the draft's state also holds the target's hidden state at each page's last
position (the next page's first entry reads it): "echo" is a head that reads almost nothing
else (tests.tiny_models.save_echo_head), so a wrong or zero state there changes its drafts."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request, State
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool
from kvstrata.model.checkpoint import load_model
from kvstrata.model.decoder import SeqBatch
from kvstrata.model.mtp import load_head, save_head
from kvstrata.model.page_state import PageStates, state_layers
from kvstrata.storage.units import PagePart, open_unit_storage
from tests.tiny_models import make_llama, save_echo_head

torch.set_num_threads(1)
PAGE = 8
TARGET_LAYERS = 4
DRAFT = "self:2"

Pages = dict[int, torch.Tensor]  # page key -> [layers, 2, page, kv_heads, head_dim]


CKPT = {"seed": 5, "num_hidden_layers": TARGET_LAYERS, "max_position_embeddings": 1024}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def conversation(turns: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    hist: list[int] = []
    out = []
    for _ in range(turns):
        hist = hist + [rng.randrange(5, 97) for _ in range(rng.randrange(20, 40))]
        out.append(list(hist))
    return out


def _pages(eng, keys: list[int], ids: list[int]) -> Pages:  # noqa: ANN001
    return {k: eng.pool.data[:, :, p].clone() for k, p in zip(keys, ids, strict=True)}


def _demote(eng, device_pages: int) -> None:  # noqa: ANN001
    """Push every cached page out of device memory (as tests/test_engine_cache.py does)."""
    ids = eng.cache.alloc_device(eng.cache.tiers.device.num_free)
    eng.cache.tiers.evict_device(device_pages)
    eng.cache.drain()
    eng.cache.free_device(ids)


def run_turns(
    model,
    tiers: str,
    store: Path,
    prompts,
    cache_dir: Path,
    demote: bool = False,
    draft: str = DRAFT,
    model_dir: str = "",
):  # noqa: ANN001, ANN201
    """Turn by turn; per turn (output, acceptances, hits, restored pages, cached pages).
    `model_dir`: the checkpoint of `model` (a draft read from its weights needs it)."""
    cfg = CacheConfig(
        page_size=PAGE,
        device_pages=64,
        host_pages=64,
        storage_url=f"file://{store}",
        prefetch_policy="wait_complete",
    )
    econf = EngineConfig(
        spec_draft=draft,
        spec_tokens=3,
        model_cache_dir=str(cache_dir),
        model=model_dir,
    )
    built = build_engine(econf, cfg.with_tiers(tiers), model=model)
    eng = built.engine
    results = []
    for i, prompt in enumerate(prompts):
        req = Request(f"t{i}", prompt, max_new_tokens=12)
        eng.submit(req)
        restored: Pages = {}
        while eng.has_work():
            eng.step()
            eng.check_integrity()
            if req.state is not State.WAITING and not restored and req.lease is not None:
                n = sum(req.hits.values())  # hit pages are final: read them once admitted
                restored = _pages(eng, req.lease.keys[:n], req.page_table[:n]) if n else {0: None}
        lease = req.lease
        cached = _pages(eng, lease.keys[: lease.inserted], lease.page_table[: lease.inserted])
        restored.pop(0, None)
        results.append((req.output, req.spec_accepts, req.hits, restored, cached))
        eng.drain()
        if demote and eng.cache is not None:
            _demote(eng, 64)
        eng.check_integrity()
    built.close()
    return results


def assert_restored(results, cold_cached: Pages, tier: str) -> int:  # noqa: ANN001
    """Every restored page equals the cold run's bytes; the draft part is real KV."""
    n = 0
    for _out, _acc, hits, restored, _cached in results:
        assert len(restored) == sum(hits.values())
        for key, data in restored.items():
            ref = cold_cached[key]
            assert torch.equal(data[TARGET_LAYERS:], ref[TARGET_LAYERS:]), f"{tier}: draft part"
            assert torch.equal(data[:TARGET_LAYERS], ref[:TARGET_LAYERS]), f"{tier}: target part"
            assert bool(ref[TARGET_LAYERS:].abs().sum() > 0)  # the draft layers were written
            n += 1
    return n


def assert_same_acceptance(a, b) -> None:  # noqa: ANN001
    for (out_a, acc_a, *_), (out_b, acc_b, *_) in zip(a, b, strict=True):
        assert out_a == out_b
        assert acc_a == acc_b


def assert_pages_as_fresh(model, prompts, results, tmp: Path, draft: str) -> None:  # noqa: ANN001
    """The last turn's pages (written after restoring earlier turns' pages) equal, within fp32
    tolerance, those of a fresh engine that computed its whole prompt: the draft's entries
    after each hit boundary read the real target state there (a zero state differs at once)."""
    fresh = run_turns(model, "device", tmp / "unused", [prompts[-1]], tmp, draft=draft)[0][4]
    got = results[-1][4]
    common = sorted(set(fresh) & set(got))
    assert len(common) >= 3
    for key in common:
        torch.testing.assert_close(got[key], fresh[key], rtol=1e-4, atol=1e-5)


DRAFTS = ["self:2", "echo"]  # a draft model (2 tail layers), an MTP head (1 + state layers)


def spec_draft(draft: str, ckpt: Path, tmp_path: Path) -> str:
    """`draft`, with "echo" made into the echo head's --spec-draft."""
    return save_echo_head(ckpt, tmp_path / "echo.safetensors") if draft == "echo" else draft


@pytest.mark.parametrize("draft", DRAFTS)
def test_restore_from_device_and_host_keeps_draft_kv_and_acceptance(
    ckpt: Path, tmp_path: Path, draft: str
) -> None:
    model = load_model(ckpt)
    draft = spec_draft(draft, ckpt, tmp_path)
    prompts = conversation(4)
    cold = run_turns(model, "none", tmp_path / "s0", prompts, tmp_path, draft=draft)
    plain = run_turns(model, "none", tmp_path / "s0", prompts, tmp_path, draft="")
    assert [r[0] for r in cold] == [r[0] for r in plain]  # greedy tokens as without drafts
    assert sum(sum(r[1]) for r in cold) > 0  # some drafts accepted
    device = run_turns(model, "device", tmp_path / "s1", prompts, tmp_path, draft=draft)
    assert_same_acceptance(cold, device)
    assert_pages_as_fresh(model, prompts, device, tmp_path, draft)
    cached = {k: v for r in device for k, v in r[4].items()}
    assert (
        all(r[2]["device"] == len(r[3]) for r in device)
        and assert_restored(device, cached, "device") > 6
    )
    host = run_turns(
        model, "device_host", tmp_path / "s2", prompts, tmp_path, demote=True, draft=draft
    )
    assert_same_acceptance(cold, host)
    assert_pages_as_fresh(model, prompts, host, tmp_path, draft)
    cached = {k: v for r in host for k, v in r[4].items()}
    assert [r[2]["device"] for r in host] == [0] * 4
    assert assert_restored(host, cached, "host") > 6 and all(r[2]["host"] for r in host[1:])


def _child(ckpt: str, store: str, cache_dir: str, prompts, out: str, draft: str) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    res = run_turns(
        load_model(ckpt), "device_host_storage", Path(store), prompts, Path(cache_dir), draft=draft
    )
    torch.save(res, out)


@pytest.mark.parametrize("draft", DRAFTS)
def test_restore_from_storage_in_a_fresh_process(ckpt: Path, tmp_path: Path, draft: str) -> None:
    model = load_model(ckpt)
    draft = spec_draft(draft, ckpt, tmp_path)
    prompts = conversation(3, seed=4)
    cold = run_turns(model, "none", tmp_path / "unused", prompts, tmp_path, draft=draft)
    first = run_turns(
        model, "device_host_storage", tmp_path / "store", prompts, tmp_path, draft=draft
    )
    cached = {k: v for r in first for k, v in r[4].items()}
    out = tmp_path / "child.pt"
    args = (str(ckpt), str(tmp_path / "store"), str(tmp_path), prompts, str(out), draft)
    proc = mp.get_context("spawn").Process(target=_child, args=args)
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    child = torch.load(out)
    assert child[0][2] == {"device": 0, "host": 0, "storage": (len(prompts[0]) - 1) // PAGE}
    assert assert_restored(child[:1], cached, "storage") == (len(prompts[0]) - 1) // PAGE
    # later turns also hit pages the child computed itself (a first turn's last page, through
    # another attention route than the cold run's: equal within float tolerance, not in bits);
    # every page restored from a tier equals the bytes of the run that computed it
    own = {k: v for r in child[:-1] for k, v in r[4].items()}
    assert_restored(child, {**cached, **own}, "storage")
    assert_same_acceptance(cold, child)
    assert_pages_as_fresh(model, prompts, child, tmp_path, draft)


def test_namespace_names_the_draft(ckpt: Path, tmp_path: Path) -> None:
    """KV made with one draft is never served to another: a draft of the same shape (2 layers)
    but other weights gets no storage hit from pages stored with self:2."""
    model = load_model(ckpt)
    prompts = conversation(2, seed=6)
    run_turns(model, "device_host_storage", tmp_path / "store", prompts, tmp_path)
    again = run_turns(model, "device_host_storage", tmp_path / "store", prompts, tmp_path)
    assert again[0][2]["storage"] == (len(prompts[0]) - 1) // PAGE  # same draft: served
    other = str(make_llama(tmp_path / "other", seed=9, num_hidden_layers=2))
    stranger = run_turns(
        model, "device_host_storage", tmp_path / "store", prompts, tmp_path, draft=other
    )
    assert stranger[0][2]["storage"] == 0
    run_turns(
        model, "device_host_storage", tmp_path / "store", prompts, tmp_path, draft="mtp:random"
    )
    save_head(load_head("mtp:random", model), tmp_path / "head.safetensors")
    state = load_file(str(tmp_path / "head.safetensors"))
    state["layer.mlp.up_proj.weight"].mul_(2.0)  # an MTP head of the same shape, other weights
    save_file(state, str(tmp_path / "head.safetensors"))
    mtp = f"mtp:{tmp_path / 'head.safetensors'}"
    mine = run_turns(model, "device_host_storage", tmp_path / "store", prompts, tmp_path, draft=mtp)
    assert mine[0][2]["storage"] == 0 and again[0][2]["storage"] > 0


def test_page_keeps_the_target_state_at_its_last_position(ckpt: Path, tmp_path: Path) -> None:
    """Each cached page's state layers hold the target's hidden state at the page's last
    position, as a from-scratch forward of the prompt computes it (fp32, rel <= 1e-4)."""
    model = load_model(ckpt)
    draft = spec_draft("echo", ckpt, tmp_path)
    prompt = conversation(1, seed=8)[0]
    (res,) = run_turns(model, "device", tmp_path / "unused", [prompt], tmp_path, draft=draft)
    cached = list(res[4].values())  # the prompt's full pages, in order (outputs may follow)
    n_pages = len(prompt) // PAGE
    assert len(cached) >= n_pages >= 3
    shape = model.kv_shape(PAGE)
    ref_pool = DevicePool(shape, n_pages + 1)
    states: list[torch.Tensor] = []
    batch = SeqBatch.build([prompt], [0], [list(range(n_pages + 1))])
    model(batch, ref_pool, hidden_out=states)
    n_state = state_layers(shape, model.spec.hidden_size)
    layers = TARGET_LAYERS + 1 + n_state
    page_pool = DevicePool(dataclasses.replace(shape, num_layers=layers), 1)
    slots = PageStates(TARGET_LAYERS + 1, n_state, model.spec.hidden_size)
    for i in range(n_pages):
        page_pool.data[:, :, 0] = cached[i]
        want = states[0][(i + 1) * PAGE - 1]
        got = slots.read(page_pool, 0)[0]
        assert float((got - want).norm() / want.norm()) <= 1e-4, f"page {i}"


def test_page_without_draft_state_is_a_miss(ckpt: Path, tmp_path: Path) -> None:
    """An older version's store: the same page keys holding target + head KV but no state
    layers. The new layout never reads them (a miss, storage = 0), and the run drafts as cold."""
    model = load_model(ckpt)
    draft = spec_draft("echo", ckpt, tmp_path)
    prompts = conversation(1, seed=9)
    first = run_turns(
        model, "device_host_storage", tmp_path / "new", prompts, tmp_path, draft=draft
    )
    again = run_turns(
        model, "device_host_storage", tmp_path / "new", prompts, tmp_path, draft=draft
    )
    assert again[0][2]["storage"] == (len(prompts[0]) - 1) // PAGE  # the new store serves
    cached = first[0][4]
    s = model.kv_shape(PAGE)
    old = KVShape(TARGET_LAYERS + 1, s.num_kv_heads, s.head_dim, PAGE, s.dtype)
    part = PagePart(old, (0, old.num_layers), (0, old.num_kv_heads))
    store = open_unit_storage(f"file://{tmp_path / 'old'}", part)
    pages = [v[: old.num_layers].contiguous().view(torch.uint8).numpy() for v in cached.values()]
    assert store.put(list(cached), pages) == len(cached)
    store.close()
    stale = run_turns(
        model, "device_host_storage", tmp_path / "old", prompts, tmp_path, draft=draft
    )
    assert stale[0][2] == {"device": 0, "host": 0, "storage": 0}
    cold = run_turns(model, "none", tmp_path / "unused", prompts, tmp_path, draft=draft)
    assert_same_acceptance(cold, stale)
    assert_same_acceptance(cold, again)
    assert sum(cold[0][1]) > 0

"""A cache's tier set follows from its fields (`CacheConfig.tiers`); `--tiers` is a preset that
sets those fields (`CacheConfig.with_tiers`), and the engine builds exactly the tiers they say."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.cache.config import TIER_SETS, CacheConfig
from kvstrata.cli.main import build_parser
from kvstrata.cli.serve_cmd import configs
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.model.checkpoint import load_model

STORE = "file:///tmp/kvstrata-tiers-unused"
CKPT = {"seed": 4, "max_position_embeddings": 256}


@pytest.mark.parametrize(
    ("fields", "tiers"),
    [
        ({}, "device_host"),
        ({"host_pages": 0}, "device"),
        ({"storage_url": STORE}, "device_host_storage"),
        ({"host_pages": 0, "prefix_cache": False}, "none"),
    ],
)
def test_the_tier_set_is_derived_from_the_fields(fields: dict, tiers: str) -> None:
    assert CacheConfig(**fields).tiers == tiers


def test_each_preset_sets_the_fields_that_make_it() -> None:
    full = CacheConfig(host_pages=32, storage_url=STORE)
    made = {t: full.with_tiers(t) for t in TIER_SETS}
    assert {t: c.tiers for t, c in made.items()} == {t: t for t in TIER_SETS}
    fields = {t: (c.prefix_cache, c.host_pages, c.storage_url) for t, c in made.items()}
    assert fields == {
        "none": (False, 0, ""),
        "device": (True, 0, ""),
        "device_host": (True, 32, ""),
        "device_host_storage": (True, 32, STORE),
    }
    assert made["none"].with_tiers("device").tiers == "device"  # a preset turns the cache back on


@pytest.mark.parametrize(
    ("cfg", "tiers", "words"),
    [
        (CacheConfig(), "device_host_storage", "tiers device_host_storage needs --storage-url"),
        (CacheConfig(host_pages=0), "device_host", "tiers device_host needs host_pages > 0"),
        (CacheConfig(), "host", "tiers must be one of none, device, device_host, device_host_st"),
    ],
)
def test_a_preset_the_fields_cannot_make_is_refused(
    cfg: CacheConfig, tiers: str, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        cfg.with_tiers(tiers)


def test_no_cache_with_host_pages_or_storage_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix_cache off .* got host_pages 1024, storage_url ''"):
        CacheConfig(prefix_cache=False)
    with pytest.raises(ValueError, match="got host_pages 8, storage_url 'file:///s'"):
        CacheConfig(prefix_cache=False, host_pages=8, storage_url="file:///s")


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([], ("device_host", 1024, "")),
        (["--storage-url", STORE], ("device_host_storage", 1024, STORE)),
        (["--host-pages", "0"], ("device", 0, "")),
        (["--tiers", "none"], ("none", 0, "")),
        (["--tiers", "device", "--host-pages", "50"], ("device", 0, "")),
        (["--tiers", "device_host", "--storage-url", STORE], ("device_host", 1024, "")),
        (["--tiers", "device_host_storage", "--storage-url", STORE], ("device_host_storage", 1024, STORE)),
    ],
)  # fmt: skip
def test_serve_takes_its_tiers_from_the_options_or_the_preset(
    argv: list[str], want: tuple[str, int, str]
) -> None:
    args = build_parser().parse_args(["serve", *argv])
    cache = configs(args)[1]
    assert (cache.tiers, cache.host_pages, cache.storage_url) == want


@pytest.mark.parametrize("tiers", TIER_SETS)
def test_the_engine_builds_the_tiers_its_cache_config_says(
    tiers: str, ckpt: Path, tmp_path: Path
) -> None:
    cfg = CacheConfig(page_size=8, device_pages=16, host_pages=16, storage_url=str(tmp_path))
    built = build_engine(EngineConfig(), cfg.with_tiers(tiers), model=load_model(ckpt))
    cache = built.engine.cache
    made = (
        cache is not None,
        cache is not None and cache.tiers.host is not None,
        built.mover is not None and built.mover.storage is not None,
    )
    built.close()
    assert (
        made
        == {
            "none": (False, False, False),
            "device": (True, False, False),
            "device_host": (True, True, False),
            "device_host_storage": (True, True, True),
        }[tiers]
    )

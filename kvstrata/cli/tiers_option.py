"""`--tiers`: a preset over the cache options, not a config field of its own.

The tier set a server runs is what its CacheConfig says (`CacheConfig.tiers`: host_pages,
storage_url, prefix_cache); `--tiers SET` sets those fields in one go (`CacheConfig.with_tiers`),
over --host-pages / --storage-url where it leaves a tier out. Without it the options decide:
the defaults make device_host, a --storage-url device_host_storage.
"""

from __future__ import annotations

import argparse

from kvstrata.cache.config import TIER_SETS, CacheConfig


def add_tiers_option(p: argparse.ArgumentParser) -> None:
    """`--tiers`, listed in CacheConfig's help group (after its fields are added)."""
    group = next((g for g in p._action_groups if g.title == CacheConfig.__name__), p)
    group.add_argument(
        "--tiers", choices=TIER_SETS, default=None,
        help="cache tiers preset: none (no prefix cache), device (--host-pages 0, no storage), "
        "device_host (no storage), device_host_storage (needs --storage-url); default: what "
        "--host-pages and --storage-url make",
    )  # fmt: skip


def apply_tiers_preset(cfg: CacheConfig, args: argparse.Namespace) -> CacheConfig:
    """The cache options `cfg`, restricted to the --tiers preset when one is given."""
    return cfg.with_tiers(args.tiers) if args.tiers else cfg

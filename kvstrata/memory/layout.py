"""KV page shape and the byte layouts of the device and host pools.

The shape and its layouts live in kvstrata/kv_shape.py, below memory/ and storage/ (a storage
unit describes its part of a page by it too); the pools import them from here.
"""

from __future__ import annotations

from kvstrata.kv_shape import DTYPES, KV_LAYOUTS, KVShape

__all__ = ["DTYPES", "KV_LAYOUTS", "KVShape"]

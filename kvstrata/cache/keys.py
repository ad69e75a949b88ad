"""Deterministic chained page keys.

key(page i) = H(key(page i-1), tokens of page i), seeded by the namespace. H is xxh3-128 over the
page's int32 token bytes with the previous key's low 64 bits as the xxh3 seed; keys are
128-bit Python ints (storage names them by 32 hex digits). Never Python's `hash()`: keys are equal
across processes, machines and runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstrata.cache.native import native_chain_keys
from kvstrata.configtools import doc

KEY_LAYOUT_VERSION = 1
"""Bumped whenever the bytes of a stored page change meaning."""


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two pages of KV to be interchangeable."""

    model_fingerprint: str = doc("", "identity of the weights (hash of the checkpoint)")
    kv_dtype: str = doc("float32", "dtype of the cached K/V")
    layout_version: int = doc(KEY_LAYOUT_VERSION, "version of the stored page layout")
    tenant_salt: str = doc("", "optional per-tenant salt; tenants never share pages")
    page_size: int = doc(64, "tokens per page")
    kv_layout: str = doc("gqa", 'what a page holds: "gqa" K/V heads, "mla" latent rows')

    @functools.cached_property
    def _seed(self) -> int:
        blob = json.dumps(
            [
                self.model_fingerprint,
                self.kv_dtype,
                self.layout_version,
                self.tenant_salt,
                self.page_size,
                # a latent page never meets a GQA one; "gqa" keeps the keys it always had
                *([self.kv_layout] if self.kv_layout != "gqa" else []),
            ]
        ).encode()
        return xxhash.xxh3_128_intdigest(blob)

    def seed(self) -> int:
        """The 128-bit root key that every chain starts from."""
        return self._seed


def salted(namespace: Namespace, cache_salt: str) -> Namespace:
    """A request's namespace: its cache_salt joins the tenant salt, so two salts share no page
    (the one rule the engine, the vLLM connector and the fleet router all key by)."""
    if not cache_salt:
        return namespace
    return dataclasses.replace(namespace, tenant_salt=f"{namespace.tenant_salt}\x00{cache_salt}")


_UNSIGNED = {4: np.uint32, 8: np.uint64}
"""The unsigned view of an int32/int64 id array (parsing a dtype string costs ~1 us a call)."""


_INT32 = np.dtype(np.int32)


def as_token_array(tokens: object, vocab_size: int | None = None) -> np.ndarray:
    """Validate token ids and return them as contiguous int32; clear errors for bad input."""
    arr = np.asarray(tokens)
    if arr.dtype == _INT32 and arr.ndim == 1 and arr.size:
        # the usual prompt, on every admission: one check on the unsigned view (a negative id
        # is >= 2**31 there), no dtype dispatch; a copy only if it is strided
        limit = 2**31 if vocab_size is None else min(vocab_size, 2**31)
        unsigned = arr.view(np.uint32)
        if unsigned.item(unsigned.argmax()) >= limit:
            raise ValueError(_range_error(arr, limit))
        return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of ids, got shape {arr.shape}")
    if not arr.size:
        return np.ascontiguousarray(arr, dtype=np.int32)
    kind = arr.dtype.kind
    if kind not in "iu":
        raise TypeError(f"tokens must be integer ids, got dtype {arr.dtype}")
    limit = 2**31 if vocab_size is None else min(vocab_size, 2**31)  # ids must fit int32
    unsigned = arr
    if kind == "i":
        # one reduction checks both ends: viewed as unsigned, a negative id is >= 2**(bits-1),
        # which is >= limit for 32- and 64-bit ids (narrower ones are widened first)
        wide = arr if arr.dtype.itemsize >= 4 else arr.astype(np.int32)
        unsigned = wide.view(_UNSIGNED[wide.dtype.itemsize])  # a type, not a dtype string
    # the largest id by argmax: ~0.3 us against ~1.1 us for max() (a ufunc reduce's setup)
    if unsigned.item(unsigned.argmax()) >= limit:
        raise ValueError(_range_error(arr, limit))
    return np.ascontiguousarray(arr, dtype=np.int32)


def _range_error(arr: np.ndarray, limit: int) -> str:
    return f"tokens out of range [0, {limit}): min {int(arr.min())}, max {int(arr.max())}"


def page_keys(
    tokens: object,
    namespace: Namespace,
    vocab_size: int | None = None,
    parent_key: int | None = None,
) -> list[int]:
    """Keys of every full page of `tokens` (a trailing partial page has no key).

    `parent_key` continues a chain (the key of the page just before `tokens[0]`).
    """
    arr = as_token_array(tokens, vocab_size)
    page = namespace.page_size
    n_pages = arr.size // page
    key = namespace.seed() if parent_key is None else parent_key
    return chain_keys(memoryview(arr[: n_pages * page]).cast("B"), page * 4, key)


def chain_keys(
    data: bytes | memoryview,
    page_bytes: int,
    key: int,
    start: int = 0,
    stop: int | None = None,
    width: int = 4,
) -> list[int]:
    """Keys of the whole pages in data[start:stop] (token ids stored `width` bytes each: 4 as
    int32, 2 as uint16), chained after `key` (the key of the page before, or a namespace seed).
    The one place the chain step is taken: native (`_chainhash.c`: xxh3-128 of each page's
    int32 bytes seeded by the previous key's low 64 bits, the value of
    `xxhash.xxh3_128_intdigest(page, key & (2**64 - 1))`), about 4x the Python loop's speed. A
    2-byte page is widened to int32 first: its key equals the int32 page's."""
    stop = len(data) if stop is None else stop
    return native_chain_keys(data, page_bytes, key, start, stop, width)


def token_width(vocab_size: int | None) -> int:
    """Bytes per stored token id: 2 when every id of the vocab fits 16 bits, else 4 (also when
    the vocab is unknown). One namespace's chains all come from one model, so one width."""
    return 2 if vocab_size is not None and vocab_size <= 2**16 else 4


def token_bytes(arr: np.ndarray, width: int) -> bytes:
    """The bytes of validated int32 ids (`as_token_array`) stored `width` bytes each."""
    if width == 4:
        return arr.tobytes()
    unsigned = arr.view(np.uint32)
    if arr.size and unsigned.item(unsigned.argmax()) >= 2**16:
        raise ValueError(f"token id {int(arr.max())} does not fit the 2-byte width of its chain")
    return arr.astype(np.uint16).tobytes()


def key_hex(key: int) -> str:
    """The storage name of a page key: 32 lowercase hex digits."""
    return f"{key:032x}"

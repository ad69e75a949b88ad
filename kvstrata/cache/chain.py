"""One request's full pages: their token bytes and their chained keys, hashed only when needed.

Token ids are kept 2 bytes each when the model's vocab fits 16 bits (`token_width`), else 4;
the keys hash int32 bytes either way (keys.py), so the width only changes what is kept.

A request's page keys are needed for the pages the tree does not hold yet (a storage probe, an
insert), never for the pages a match walks: the tree keeps each node's token bytes and finds
children by them, and the matched pages' keys come from the nodes (`learn`). So admission of
a follow-up turn hashes only the pages past what the tree holds. A chain built from keys alone
(`from_keys`: traces, tests) has no tokens and is matched by keys, as before.
"""

from __future__ import annotations

from kvstrata.cache.keys import (
    Namespace,
    as_token_array,
    chain_keys,
    token_bytes,
    token_width,
)


class PageChain:
    """Token bytes (`width` bytes an id, full pages only) and the keys of the leading pages known
    so far.

    Invariant: `keys[i]` is the chained key of page i under `seed` (a namespace's root key);
    with tokens, `len(keys) <= pages`.
    """

    __slots__ = ("seed", "page_bytes", "data", "keys", "width")

    def __init__(
        self, seed: int, page_size: int, data: bytes | None, keys: list[int], width: int = 4
    ) -> None:
        self.seed = seed
        self.width = width  # bytes per id in data (2: uint16, 4: int32)
        self.page_bytes = page_size * width
        self.data = data  # None: a key-only chain
        self.keys = keys

    @classmethod
    def from_tokens(
        cls, tokens: object, namespace: Namespace, vocab_size: int | None = None
    ) -> PageChain:
        """Validated token ids; a trailing partial page is dropped (it has no key). Ids are kept
        `token_width(vocab_size)` bytes each."""
        arr = as_token_array(tokens, vocab_size)
        page, width = namespace.page_size, token_width(vocab_size)
        full = arr.size // page * page
        # no view to slice when the prompt is whole pages
        data = token_bytes(arr if full == arr.size else arr[:full], width)
        return cls(namespace.seed(), page, data, [], width)

    @classmethod
    def from_keys(cls, keys: list[int], page_size: int) -> PageChain:
        """A chain known only by its keys (no token bytes: the tree matches it by key)."""
        return cls(0, page_size, None, list(keys))

    @property
    def pages(self) -> int:
        """Full pages of the chain (keys known or not)."""
        return len(self.keys) if self.data is None else len(self.data) // self.page_bytes

    def extend_tokens(self, tokens: object, vocab_size: int | None = None) -> None:
        """Append whole pages of token ids (generated ones); their keys are hashed later."""
        assert self.data is not None, "a key-only chain grows by extend_keys"
        raw = token_bytes(as_token_array(tokens, vocab_size), self.width)
        if len(raw) % self.page_bytes:
            n = len(raw) // self.width
            raise ValueError(f"extend_tokens takes whole pages, got {n} tokens")
        self.data += raw

    def extend_keys(self, more: list[int]) -> None:
        assert self.data is None, "a token chain's keys are hashed from its tokens"
        self.keys.extend(more)

    def learn(self, keys: list[int]) -> None:
        """Keys of the leading pages, read from the tree's nodes (no hashing)."""
        if len(keys) > len(self.keys):
            self.keys = keys

    def keys_upto(self, n: int) -> list[int]:
        """Keys of the first n pages, hashing only those not known yet (chained from the last
        known key)."""
        have = len(self.keys)
        if n > have and self.data is not None:
            p = self.page_bytes
            n = min(n, self.pages)
            parent = self.keys[-1] if have else self.seed
            self.keys += chain_keys(self.data, p, parent, have * p, n * p, self.width)
        return self.keys[:n]

    def tokens(self, start: int, end: int) -> bytes | None:
        """Token bytes of pages [start, end), or None for a key-only chain."""
        if self.data is None:
            return None
        return self.data[start * self.page_bytes : end * self.page_bytes]

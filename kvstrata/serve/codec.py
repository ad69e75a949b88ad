"""Text <-> token ids for the server: the checkpoint's tokenizer, or a byte codec without one.

Tiny random test checkpoints ship no tokenizer; the byte codec folds UTF-8 bytes into the
vocabulary and shows ids as printable ASCII, so text round trips are not exact but every
request is deterministic. Real checkpoints (SmolLM2) use their own tokenizer and chat template.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Codec(Protocol):
    eos_token_ids: list[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...


class ByteCodec:
    """For checkpoints without tokenizer files (no EOS: requests end at max_tokens)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(32 + i % 95) for i in ids)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)


class HFCodec:
    """The checkpoint's Hugging Face tokenizer (its chat template, or plain text turns)."""

    def __init__(self, path: Path) -> None:
        from kvstrata.model.tokenizer import Tokenizer

        self.tok = Tokenizer(path)
        self.eos_token_ids = self.tok.eos_token_ids

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.tok.encode_chat(messages)  # plain text turns when there is no template


def open_codec(model_path: Path, vocab_size: int) -> Codec:
    if any((model_path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return HFCodec(model_path)
    return ByteCodec(vocab_size)

"""Text <-> token ids for a checkpoint directory, via its Hugging Face tokenizer files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    """Plain encode/decode and chat-template encoding of one checkpoint's tokenizer."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path)
        if not root.is_dir():
            raise ValueError(f"tokenizer path {root} is not a directory")
        from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed

        try:
            self.hf: Any = AutoTokenizer.from_pretrained(str(root))
        except (OSError, ValueError) as e:
            raise ValueError(f"{root} holds no loadable tokenizer: {e}") from e

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template (base checkpoints often do not)."""
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation (the tokenizer's eos token)."""
        eos = self.hf.eos_token_id
        return [] if eos is None else [int(eos)]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` as is (no chat template)."""
        return [int(t) for t in self.hf.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def encode_chat(self, messages: str | Sequence[dict[str, str]]) -> list[int]:
        """Ids of a conversation as `render_chat` writes it, ending in the assistant prompt.

        A plain string is one user message.
        """
        # The template already wrote every special token (e.g. <|im_start|>); adding more would
        # put a BOS in front that the model never saw in training.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def render_chat(self, messages: str | Sequence[dict[str, str]]) -> str:
        """The conversation as the chat template writes it, ending in the assistant prompt (the
        text a completions client sends as is); plain text turns (`plain_turns`) when the
        tokenizer has no template (a base checkpoint). A plain string is one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.has_chat_template:
            return plain_turns(messages)
        return str(
            self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        )


def plain_turns(messages: Sequence[dict[str, str]]) -> str:
    """A conversation as plain text: one `role: content` line per message, then the assistant's
    cue. The one rendering for a tokenizer with no chat template, so `run`, the workloads and the
    serve chat endpoint give a base checkpoint the same prompt for the same conversation."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def chat_encoder(model_path: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer (for its chat encoding), or None when it ships none."""
    if not any((model_path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return Tokenizer(model_path)

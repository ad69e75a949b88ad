"""What a client asks the cache to keep: `cache_control` blocks of a chat, `kv_pin_s` of a
completion, read into the pins (kvstrata.cache.pins.PinSpec) its request carries.

Chat: a message, or a content part of the OpenAI list form, carrying
`"cache_control": {"type": "ephemeral", "ttl": "5m" | "1h"}` (Anthropic's prompt caching; ttl
optional, 5m by default) pins the prompt up to and including it. Its end in tokens is where the
chat template's encoding of the messages cut after that block stops agreeing with the whole
prompt's. Completions: `"kv_pin_s": seconds` pins the whole prompt. Anything else is a 400
naming the field and the value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstrata.cache.pins import DEFAULT_TTL_S, MAX_TTL_S, TTL_CHOICES_S, PinSpec
from kvstrata.serve.protocol import ApiError, ChatMessage, ChatRequest, CompletionRequest

EncodeChat = Callable[[Sequence[dict[str, str]]], list[int]]
MAX_BREAKPOINTS = 4  # cache_control blocks per request, as Anthropic's API allows


def request_pins(
    body: ChatRequest | CompletionRequest, tokens: list[int], encode_chat: EncodeChat
) -> tuple[PinSpec, ...]:
    """The pins a request body asks for (none without hints); a 400 for a bad hint."""
    if isinstance(body, CompletionRequest):
        secs = (body.model_extra or {}).get("kv_pin_s")
        return () if secs is None else (PinSpec(len(tokens), _pin_seconds(secs)),)
    marks = _breakpoints(body.messages)
    if len(marks) > MAX_BREAKPOINTS:
        raise ApiError(
            400, f"at most {MAX_BREAKPOINTS} cache_control blocks, got {len(marks)}", "messages"
        )
    pins = []
    for upto, ttl_s in marks:
        cut = encode_chat(upto)
        pins.append(PinSpec(_common_prefix(cut, tokens), ttl_s))
    return tuple(pins)


def _breakpoints(messages: list[ChatMessage]) -> list[tuple[list[dict[str, str]], float]]:
    """Each cache_control block: (the messages cut just after it, its TTL in seconds)."""
    out = []
    msgs = [{"role": m.role, "content": m.text()} for m in messages]
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                where = f"messages.{i}.content.{j}.cache_control"
                ttl = _ttl((part.model_extra or {}).get("cache_control"), where)
                if ttl is not None:
                    text = "".join(p.text for p in m.content[: j + 1])
                    out.append(([*msgs[:i], {"role": m.role, "content": text}], ttl))
        ttl = _ttl((m.model_extra or {}).get("cache_control"), f"messages.{i}.cache_control")
        if ttl is not None:
            out.append((msgs[: i + 1], ttl))
    return out


def _ttl(block: Any, where: str) -> float | None:
    """A cache_control block's TTL in seconds (None: no block)."""
    if block is None:
        return None
    if not isinstance(block, dict):
        raise ApiError(400, f"{where} must be an object, got {block!r}", where)
    kind = block.get("type", "ephemeral")
    if kind != "ephemeral":
        raise ApiError(400, f"{where}.type must be 'ephemeral', got {kind!r}", f"{where}.type")
    ttl = block.get("ttl")
    if ttl is None:
        return DEFAULT_TTL_S
    if ttl not in TTL_CHOICES_S:
        choices = " or ".join(repr(k) for k in TTL_CHOICES_S)
        raise ApiError(400, f"{where}.ttl must be {choices}, got {ttl!r}", f"{where}.ttl")
    return TTL_CHOICES_S[ttl]


def _pin_seconds(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not 0 < value <= MAX_TTL_S:
        raise ApiError(
            400, f"kv_pin_s must be a number in (0, {MAX_TTL_S:g}], got {value!r}", "kv_pin_s"
        )
    return float(value)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

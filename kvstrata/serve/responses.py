"""Response bodies and SSE chunks in the OpenAI shape, and incremental text with stop strings."""

from __future__ import annotations

import time
from typing import Any

from kvstrata.http.sse import sse
from kvstrata.serve.codec import Codec
from kvstrata.serve.request_record import RequestRecord


class TextState:
    """Decoded text of one request's output, cut at the first stop string.

    Streaming holds back the last len(longest stop) - 1 characters (they may start a stop
    string) and a trailing incomplete UTF-8 character.
    """

    def __init__(self, codec: Codec, stop: tuple[str, ...], stop_ids: frozenset[int]) -> None:
        self.codec, self.stop, self.stop_ids = codec, stop, stop_ids
        self.ids: list[int] = []
        self.n_tokens = 0  # every consumed token, stop tokens included
        self.sent = 0
        self.stopped = False  # a stop string was seen
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token: int) -> str:
        """The new text that may be shown after `token`."""
        self.n_tokens += 1
        if token in self.stop_ids:
            return ""
        self.ids.append(token)
        text = self._text()
        safe = len(text) if self.stopped else len(text) - self.hold
        if not self.stopped and text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta

    def flush(self) -> str:
        text = self._text()
        delta, self.sent = text[self.sent :], len(text)
        return delta

    def _text(self) -> str:
        text = self.codec.decode(self.ids)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                text, self.stopped = text[:at], True
        return text


def usage(
    req: RequestRecord, page_size: int, completion_tokens: int, speculative: bool = False
) -> dict[str, Any]:
    """OpenAI's usage; with speculative decoding on, also `spec` (spec_usage)."""
    by_tier = {t: n * page_size for t, n in req.hits.items()}
    prompt = len(req.tokens)
    pd = {"pd": dict(req.transfer)} if req.transfer is not None else {}
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(by_tier.values()),
            "cached_tokens_by_tier": by_tier,
            "pinned_tokens": req.pinned_pages * page_size,  # kept by its cache_control pins
        },
        **pd,  # P/D decode: what crossed from prefill
    }
    if speculative:
        out["spec"] = spec_usage(req)
    return out


def spec_usage(req: RequestRecord) -> dict[str, Any]:
    """One request's speculation: verify steps, drafted and accepted tokens, acceptance rate
    (accepted / proposed) and mean accepted length (tokens per verify step, the target's own
    included: 1 + accepted / verify_steps; 0.0 before any verify step), and `accepts`: the
    accepted drafts of each verify step in order (equal after any restore or P/D transfer)."""
    accepted = sum(req.spec_accepts)
    return {
        "verify_steps": len(req.spec_accepts),
        "proposed": req.spec_proposed,
        "accepted": accepted,
        "acceptance_rate": req.acceptance_rate,
        "mean_accepted_length": req.accept_length,
        "accepts": list(req.spec_accepts),
    }


def finish_reason(req: RequestRecord | None, state: TextState) -> str:
    if state.stopped:
        return "stop"
    if req is None or req.finish_reason is None:
        return "abort"
    return req.finish_reason


def head(rid: str, model: str, obj: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model}


def full_body(chat: bool, rid: str, model: str, text: str, reason: str, use: dict) -> dict:
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": reason,
        }
        return {**head(rid, model, "chat.completion"), "choices": [choice], "usage": use}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {**head(rid, model, "text_completion"), "choices": [choice], "usage": use}


def chunk(
    chat: bool, rid: str, model: str, text: str, reason: str | None, first: bool = False
) -> str:
    if chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return sse({**head(rid, model, "chat.completion.chunk"), "choices": [choice]})
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return sse({**head(rid, model, "text_completion"), "choices": [choice]})


def usage_chunk(chat: bool, rid: str, model: str, use: dict[str, Any]) -> str:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return sse({**head(rid, model, obj), "choices": [], "usage": use})

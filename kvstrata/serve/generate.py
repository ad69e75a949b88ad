"""One completion or chat request through the engine loop: whole or as an SSE stream."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvstrata.http.errors import ApiError
from kvstrata.http.sse import DONE, sse
from kvstrata.serve import responses as R
from kvstrata.serve.cache_hints import request_pins
from kvstrata.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    Prepared,
    prepare,
    single_prompt,
)
from kvstrata.serve.request_record import RequestRecord
from kvstrata.serve.state import ServerState
from kvstrata.serve.stream import QueueFull, Stream

DISCONNECT_POLL_S = 0.25


def prompt_tokens(state: ServerState, body: CompletionRequest | ChatRequest) -> list[int]:
    if isinstance(body, ChatRequest):
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        return state.codec.encode_chat(msgs)
    prompt = single_prompt(body)
    return state.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)


def prepared(state: ServerState, body: CompletionRequest | ChatRequest) -> Prepared:
    tokens = prompt_tokens(state, body)
    if isinstance(body, ChatRequest):
        max_new = body.max_completion_tokens or body.max_tokens
        if max_new is None:
            room = state.limits.max_model_len - len(tokens)
            max_new = max(1, min(state.cfg.default_max_tokens, room))
    else:
        max_new = body.max_tokens if body.max_tokens is not None else 16
    return prepare(body, tokens, max_new, state.limits, state.codec.eos_token_ids)


async def choose_prefill(state: ServerState, body: CompletionRequest | ChatRequest) -> str:
    """P/D decode: the prefill worker of this request ("" on other roles). A name outside the
    configured set is refused (403) before anything enters the engine; the check may read a
    configured worker's /v1/pd/info, so it runs off the event loop."""
    if state.pd is None or state.pd.role != "decode":
        return ""
    try:
        return await asyncio.to_thread(state.pd.choose, body.pd_prefill)
    except ValueError as exc:
        raise ApiError(getattr(exc, "status", 400), str(exc), "pd_prefill") from None


def _remote_params(remote: str, named: str | None) -> dict[str, Any] | None:
    """P/D decode's KV params: the prefill worker (a configured entry), and the transfer
    endpoints the request named when choose_prefill checked that entry listens on them."""
    if not remote:
        return None
    if named and named.startswith("tcp://") and named != remote:
        return {"prefill": remote, "prefill_endpoints": named.split(",")}
    return {"prefill": remote}


class Generation:
    """A submitted request and the text it has produced so far."""

    def __init__(
        self, state: ServerState, body: CompletionRequest | ChatRequest, remote: str = ""
    ) -> None:
        """remote: P/D decode, the prefill worker that computes the prompt (`choose_prefill`)."""
        state.check_ready()
        state.check_model(body.model)
        prep = prepared(state, body)
        self.state, self.chat = state, isinstance(body, ChatRequest)
        self.rid = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.req = RequestRecord(
            self.rid,
            prep.tokens,
            prep.max_new,
            prep.sampling,
            prep.cache_salt,
            _remote_params(remote, body.pd_prefill),  # P/D decode: who computes the prompt
            request_pins(body, prep.tokens, state.codec.encode_chat),
        )
        self.text = R.TextState(state.codec, prep.stop, prep.sampling.stop_token_ids)
        assert state.aloop is not None
        self.stream = Stream(state.aloop, time.monotonic())
        self.usage_wanted = bool(body.stream_options and body.stream_options.include_usage)
        try:
            state.loop.submit(self.req, self.stream)
        except QueueFull as exc:
            raise ApiError(503, f"server is busy: {exc}") from None
        self.ended = False
        self._first: tuple[str, Any] | None = None  # an event taken early by wait_first()

    async def _next(self, timeout: float) -> tuple[str, Any]:
        if self._first is not None:
            event, self._first = self._first, None
            return event
        return await asyncio.wait_for(self.stream.queue.get(), timeout)

    async def wait_first(self) -> None:
        """Wait for the first event (P/D decode: the KV arrived, or the hand-off failed), so
        a failure is answered with its own status instead of a 200 stream."""
        timeout = self.state.cfg.request_timeout_s
        try:
            self._first = await asyncio.wait_for(self.stream.queue.get(), timeout)
        except TimeoutError:
            self.abort()
            raise ApiError(503, f"no token within request_timeout_s={timeout}") from None
        if self._first[0] == "error":
            self.ended = True
            raise _failure(self._first[1])

    async def deltas(self) -> AsyncIterator[str]:
        """New text per token until the request ends (or a stop string shows up)."""
        timeout = self.state.cfg.request_timeout_s
        while True:
            try:
                kind, value = await self._next(timeout)
            except TimeoutError:
                self.abort()
                raise ApiError(503, f"no token within request_timeout_s={timeout}") from None
            if kind == "error":
                self.ended = True
                raise _failure(value)
            if kind == "done":
                self.ended = True
                return
            delta = self.text.add(value)
            if delta:
                yield delta
            if self.text.stopped:
                self.abort()
                return

    def abort(self) -> None:
        if not self.ended:
            self.ended = True
            self.state.loop.abort(self.rid)

    def usage(self) -> dict[str, Any]:
        page, spec = self.state.limits.page_size, self.state.speculative
        return R.usage(self.req, page, self.text.n_tokens, spec)

    def reason(self) -> str:
        return R.finish_reason(self.req if self.req.finish_reason else None, self.text)


def _failure(value: Any) -> ApiError:
    """The client's error for a failed request: (status, message) of a P/D hand-off, else 500."""
    if isinstance(value, tuple):
        return ApiError(*value)
    return ApiError(500, f"request failed: {value}")


async def complete(gen: Generation, gone: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
    """The whole answer; a client that went away (checked every DISCONNECT_POLL_S) aborts it."""

    async def collect() -> list[str]:
        return [d async for d in gen.deltas()]

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await gone():
                task.cancel()
                raise ApiError(499, "client disconnected")
        parts = task.result()
    finally:
        if not task.done():
            task.cancel()  # the handler itself was cancelled (e.g. the server stops)
        gen.abort()  # a cancelled or failed handler frees the request's pages
    parts.append(gen.text.flush())
    name = gen.state.model_name
    return R.full_body(gen.chat, gen.rid, name, "".join(parts), gen.reason(), gen.usage())


async def stream(gen: Generation) -> AsyncIterator[str]:
    """SSE frames; a client that goes away cancels this generator, which aborts the request."""
    name = gen.state.model_name
    first = True  # chat: the first chunk carries the role, sent with the first text
    try:
        try:
            async for delta in gen.deltas():
                yield R.chunk(gen.chat, gen.rid, name, delta, None, first=first)
                first = False
        except ApiError as exc:
            yield sse(exc.body())
            yield DONE
            return
        yield R.chunk(gen.chat, gen.rid, name, gen.text.flush(), gen.reason(), first=first)
        if gen.usage_wanted:
            yield R.usage_chunk(gen.chat, gen.rid, name, gen.usage())
        yield DONE
    finally:
        gen.abort()

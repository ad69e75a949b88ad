"""OpenAI request bodies (pydantic) and their translation into engine requests.

Unknown fields are accepted and ignored (clients send many), wrong types of known fields are
rejected with a 400 naming the field, and so are fields vLLM knows that this server would
otherwise ignore silently (`best_of`, `logprobs`: refused unless they ask for what is done
anyway), token ids that are not JSON integers (`true`, `1.0`: never coerced) and an empty
`cache_salt` (it would share the unsalted cache). Limits come from the model (vocabulary,
positions) and the device pool (pages), checked here so a bad request never reaches the engine
thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt

from kvstrata.engine.sampling import SamplingParams
from kvstrata.http.errors import ApiError


def _integer_ids(value: Any) -> Any:
    """A prompt as given, unless a token id in it is a JSON true/false or a number with a
    fraction or exponent: those are refused, never coerced to an integer."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            for x in item if isinstance(item, list) else (item,):
                if isinstance(x, bool | float):
                    raise ValueError(f"token ids must be integers, got {x!r} in prompt[{i}]")
    return value


def _one_sequence(value: int | None) -> int | None:
    """vLLM's best_of: only 1 (one sequence per prompt) or null."""
    if value not in (None, 1):
        raise ValueError(f"only 1 (or null) is supported: one sequence per prompt, got {value}")
    return value


def _no_logprobs(value: int | bool | None) -> int | bool | None:
    """This server returns no log-probabilities: only null (or false) is accepted, never a
    request it would answer without them."""
    if value is not None and value is not False:  # 0 too: completions' 0 asks for one each
        raise ValueError(
            f"log-probabilities are not returned by this server: send null, got {value!r}"
        )
    return value


def _no_top_logprobs(value: int | None) -> int | None:
    if value not in (None, 0):
        raise ValueError(
            f"log-probabilities are not returned by this server: send null or 0, got {value!r}"
        )
    return value


TokenIds = list[StrictInt]
"""Token ids from a client: JSON integers only (`true` or `1.0` is a 400, not coerced)."""
Prompt = Annotated[
    str | list[StrictInt] | list[str] | list[list[StrictInt]], BeforeValidator(_integer_ids)
]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    best_of: Annotated[int | None, AfterValidator(_one_sequence)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # "" would share the unsalted cache
    pd_prefill: str | None = None  # P/D decode: the prefill worker to use (the router sets it)


class CompletionRequest(_Common):
    prompt: Prompt
    logprobs: Annotated[int | None, AfterValidator(_no_logprobs)] = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Annotated[bool | None, AfterValidator(_no_logprobs)] = None
    top_logprobs: Annotated[int | None, AfterValidator(_no_top_logprobs)] = None


@dataclass(frozen=True)
class Limits:
    """What the served model and pool accept."""

    vocab_size: int
    max_model_len: int
    page_size: int
    device_pages: int


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to become an engine Request."""

    tokens: list[int]
    max_new: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    cache_salt: str


def single_prompt(body: CompletionRequest) -> str | list[int]:
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], str | list):
        if len(p) != 1:
            raise ApiError(400, "only one prompt per request is supported (n=1)", "prompt")
        return p[0]  # type: ignore[return-value]
    return p  # type: ignore[return-value]


def check_tokens(tokens: list[int], limits: Limits, param: str) -> None:
    if not tokens:
        raise ApiError(400, f"{param} is empty", param)
    bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise ApiError(
            400, f"token id {bad[0]} in {param} is out of range [0, {limits.vocab_size})", param
        )


def prepare(
    body: _Common, tokens: list[int], max_tokens: int | None, limits: Limits, eos: list[int]
) -> Prepared:
    """Validate sizes and sampling options (400 naming the field)."""
    param = "messages" if isinstance(body, ChatRequest) else "prompt"
    check_tokens(tokens, limits, param)
    if body.n != 1:
        raise ApiError(400, f"n must be 1, got {body.n}", "n")
    room = limits.max_model_len - len(tokens)
    if max_tokens is None:
        max_tokens = max(1, room)
    if len(tokens) + max_tokens > limits.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {len(tokens) + max_tokens} tokens ({len(tokens)} in the {param}, "
            f"{max_tokens} for the completion). Please reduce the length of the {param} or "
            "max_tokens.",
            "max_tokens",
        )
    pages = -(-(len(tokens) + max_tokens - 1) // limits.page_size)
    if pages > limits.device_pages:
        raise ApiError(
            400,
            f"{len(tokens)} prompt + {max_tokens} max_tokens need {pages} KV pages; the device "
            f"pool holds {limits.device_pages}",
            "max_tokens",
        )
    stop_ids = set(body.stop_token_ids or [])
    bad = [t for t in stop_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ApiError(400, f"stop_token_ids: {bad[0]} is out of range", "stop_token_ids")
    if not body.ignore_eos:
        stop_ids.update(eos)
    sampling = SamplingParams(body.temperature, body.top_p, body.seed, frozenset(stop_ids))
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stop):
        raise ApiError(400, "stop strings must not be empty", "stop")
    return Prepared(tokens, max_tokens, sampling, stop, body.cache_salt or "")

"""Reading `cache_control` blocks and `kv_pin_s` into pins, and the agent bench's trace gaps."""

from __future__ import annotations

import pytest

from kvstrata.cache.pins import PinSpec
from kvstrata.serve.cache_hints import request_pins
from kvstrata.serve.codec import ByteCodec
from kvstrata.serve.protocol import ApiError, ChatRequest, CompletionRequest
from kvstrata.workloads.turn_gaps import GapSampler, find_trace, inter_turn_gaps_s

CODEC = ByteCodec(256)


def chat(messages: list[dict]) -> tuple[ChatRequest, list[int]]:
    body = ChatRequest.model_validate({"messages": messages})
    plain = [{"role": m.role, "content": m.text()} for m in body.messages]
    return body, CODEC.encode_chat(plain)


def test_part_and_message_blocks_pin_up_to_themselves() -> None:
    ephemeral = {"type": "ephemeral"}
    body, tokens = chat([
        {"role": "system", "content": [
            {"type": "text", "text": "sys", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            {"type": "text", "text": " more"},
        ]},
        {"role": "user", "content": "question", "cache_control": ephemeral},
        {"role": "user", "content": "next"},
    ])  # fmt: skip
    pins = request_pins(body, tokens, CODEC.encode_chat)
    # the byte codec: "<system>sys" is 11 bytes; "<system>sys more\n<user>question\n" is 33
    assert pins == (PinSpec(11, 3600.0), PinSpec(33, 300.0))


def test_no_hints_no_pins_and_completions_pin_the_whole_prompt() -> None:
    body, tokens = chat([{"role": "user", "content": "hi"}])
    assert request_pins(body, tokens, CODEC.encode_chat) == ()
    comp = CompletionRequest.model_validate({"prompt": [1, 2, 3], "kv_pin_s": 90})
    assert request_pins(comp, [1, 2, 3], CODEC.encode_chat) == (PinSpec(3, 90.0),)


@pytest.mark.parametrize(
    ("block", "param", "named"),
    [
        ({"type": "ephemeral", "ttl": "30s"}, "messages.0.cache_control.ttl", "'30s'"),
        ({"type": "persistent"}, "messages.0.cache_control.type", "'persistent'"),
        ("yes", "messages.0.cache_control", "'yes'"),
    ],
)
def test_bad_blocks_are_400s_naming_field_and_value(block: object, param: str, named: str) -> None:
    body, tokens = chat([{"role": "user", "content": "hi", "cache_control": block}])
    with pytest.raises(ApiError) as err:
        request_pins(body, tokens, CODEC.encode_chat)
    assert err.value.status == 400 and err.value.param == param and named in err.value.message


@pytest.mark.parametrize("secs", [0, -1, 3601, "5m", True])
def test_bad_kv_pin_s_is_a_400(secs: object) -> None:
    comp = CompletionRequest.model_validate({"prompt": [1], "kv_pin_s": secs})
    with pytest.raises(ApiError) as err:
        request_pins(comp, [1], CODEC.encode_chat)
    assert err.value.param == "kv_pin_s" and repr(secs) in err.value.message


def test_more_than_four_blocks_is_a_400() -> None:
    msgs = [
        {"role": "user", "content": str(i), "cache_control": {"type": "ephemeral"}}
        for i in range(5)
    ]
    body, tokens = chat(msgs)
    with pytest.raises(ApiError, match="at most 4"):
        request_pins(body, tokens, CODEC.encode_chat)


def test_trace_gaps_are_same_conversation_gaps_and_draws_are_seeded() -> None:
    try:
        path = find_trace()
    except ValueError as exc:  # the shared data directory is not beside this checkout
        pytest.skip(str(exc))
    gaps = inter_turn_gaps_s(path)
    assert len(gaps) == 1782 and gaps == sorted(gaps) and gaps[0] > 0
    a, b = GapSampler(gaps, 0.01, 2.0, 0), GapSampler(gaps, 0.01, 2.0, 0)
    draws = [a.gap(s, k) for s in range(3) for k in range(4)]
    assert draws == [b.gap(s, k) for s in range(3) for k in range(4)]
    assert all(0 < g <= 2.0 for g in draws)

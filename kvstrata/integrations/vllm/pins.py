"""Client pins through vLLM: what a request's `kv_transfer_params` asks the connector to keep.

vLLM hands a connector each request's `kv_transfer_params` (the body's field of that name in
its OpenAI server). The connector reads, beside what other connectors read there:
- `"kv_pin_s": seconds`: keep the whole prompt's pages for that long after each use;
- `"kv_pins": [{"tokens": N, "ttl_s": seconds}, ...]`: keep the first N prompt tokens (whole
  pages of them), each for its own TTL (Anthropic's `cache_control` breakpoints, already
  turned into token counts by the client or a proxy).
The pins are kvstrata's (kvstrata.cache.pins): the same budget rule (`--pin-budget` of the
host tier), kept in the connector's host tier. A connector cannot answer a 400, so a bad value
is named on stderr once per request and the request runs without pins.
"""

from __future__ import annotations

import sys
from typing import Any

from kvstrata.cache.pins import PinSpec


def pins_from_params(params: Any, prompt_tokens: int, request_id: str = "") -> tuple[PinSpec, ...]:
    """The pins `params` (a request's kv_transfer_params, or None) asks for."""
    if not isinstance(params, dict):
        return ()
    try:
        return _parse(params, prompt_tokens)
    except (TypeError, ValueError) as exc:
        print(f"kvstrata connector: request {request_id}: pins ignored: {exc}", file=sys.stderr)
        return ()


def _parse(params: dict[str, Any], prompt_tokens: int) -> tuple[PinSpec, ...]:
    out = []
    secs = params.get("kv_pin_s")
    if secs is not None:
        out.append(PinSpec(prompt_tokens, _seconds(secs, "kv_pin_s")))
    pins = params.get("kv_pins")
    if pins is not None:
        if not isinstance(pins, list):
            raise TypeError(f"kv_pins must be a list, got {pins!r}")
        for i, pin in enumerate(pins):
            if not isinstance(pin, dict) or not isinstance(pin.get("tokens"), int):
                raise TypeError(f"kv_pins[{i}] must be {{'tokens': int, 'ttl_s': s}}, got {pin!r}")
            ttl = _seconds(pin.get("ttl_s", 300.0), f"kv_pins[{i}].ttl_s")
            out.append(PinSpec(min(pin["tokens"], prompt_tokens), ttl))
    return tuple(out)


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    return float(value)

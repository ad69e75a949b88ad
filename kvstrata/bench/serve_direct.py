"""The load of `kvstrata bench serve` without HTTP: the same agent sessions straight into an
in-process engine, the baseline of the server's overhead on the same load.

Same sessions, turns and concurrency as `serve_load.run_load`: a session's turn k+1 is sent
when its turn k ends, at most `concurrency` sessions at once. Prompts are the chat template of
the same messages (the server's codec), greedy, ending at EOS or max_tokens as the server's do.
TTFT is from `engine.submit` to the first token, as the engine's own clock sees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.bench.serve_load import LoadResult, LoadSpec, TurnStat, next_messages
from kvstrata.bench.serve_load import session_messages as first_messages
from kvstrata.engine.engine import Engine
from kvstrata.engine.request import Request
from kvstrata.engine.sampling import Sampler, SamplingParams
from kvstrata.serve.codec import Codec


@dataclass
class _Session:
    index: int
    msgs: list[dict[str, str]]
    rng: object
    turn: int = 0


def _submit(eng: Engine, codec: Codec, spec: LoadSpec, s: _Session) -> Request:
    rid = f"s{s.index}t{s.turn}"
    params = SamplingParams(stop_token_ids=frozenset(codec.eos_token_ids))  # greedy
    req = Request(rid, codec.encode_chat(s.msgs), spec.max_tokens, sampler=Sampler(params, rid))
    eng.submit(req)
    return req


def run_direct(eng: Engine, codec: Codec, spec: LoadSpec, tick: Callable[[], None]) -> LoadResult:
    """Every session's turns through `eng.step()`; the same statistics as run_load."""
    todo = [_Session(s, *first_messages(spec, s)) for s in range(spec.sessions)]
    todo.reverse()  # pop() takes session 0 first
    live: dict[str, tuple[_Session, Request]] = {}
    out = LoadResult()
    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < spec.concurrency:
            s = todo.pop()
            req = _submit(eng, codec, spec, s)
            live[req.rid] = (s, req)
        for req in eng.step().ended:
            s, _ = live.pop(req.rid)
            out.turns.append(_stat(s, req))
            tick()
            s.turn += 1
            if s.turn < spec.turns:
                stops = set(codec.eos_token_ids)
                reply = codec.decode([t for t in req.output if t not in stops])
                s.msgs = next_messages(s.msgs, reply, s.rng, spec)  # type: ignore[arg-type]
                nxt = _submit(eng, codec, spec, s)
                live[nxt.rid] = (s, nxt)
    out.wall_s = time.perf_counter() - t0
    return out


def _stat(s: _Session, req: Request) -> TurnStat:
    assert req.first_token_s is not None and req.finish_s is not None
    cached = sum(req.hits.values()) * (req.lease.page if req.lease is not None else 0)
    return TurnStat(
        s.index,
        s.turn,
        req.first_token_s - req.arrival_s,
        req.finish_s - req.arrival_s,
        len(req.tokens),
        cached,
        len(req.output),
    )

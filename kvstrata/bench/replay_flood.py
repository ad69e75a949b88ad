"""`kvstrata bench replay_flood`: TTFT while a subscriber floods the KV events replay socket, over
the quiet TTFT of the same server, in one run.

One `kvstrata serve` (SmolLM2 unless --model) publishes KV events with a replay socket. Phases,
each a series of cold prompts (each new: every one is prefilled and publishes events), one at a
time, streamed: quiet, flood, quiet again. During the flood another process sends replay
requests from seq 0 as fast as ZMQ takes them and drains what comes back. The replay socket is
served by a thread of its own at a bounded pace and rate per subscriber
(kvstrata/serve/event_replay.py): the flooder gets a few answers, the engine keeps its pace.
Reports the median TTFT of each phase, flood over the mean of the quiet ones (goal <= 1.2), and
the flooder's requests sent and answered.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import zmq

from kvstrata.bench.registry import BENCHES
from kvstrata.local_ports import free_port

GOAL = 1.2  # flood TTFT over quiet TTFT
QUICK = {"prompts": 4, "prompt_tokens": 128}
FULL = {"prompts": 16, "prompt_tokens": 1024}
ENGINE_ARGS = ["--page-size", "16", "--device-pages", "512", "--host-pages", "1024"]


def flood(endpoint: str, stop: Any, out: Any) -> None:
    """A flooder process: replay requests from seq 0 until `stop`; puts (sent, answered)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sent = answered = 0
    while not stop.is_set():
        try:
            sock.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
            sent += 1
        except zmq.Again:  # the server reads no faster than its pace: its queue is full
            time.sleep(0.0005)
        while sock.poll(0):
            if sock.recv_multipart()[1] == (-1).to_bytes(8, "big", signed=True):
                answered += 1
    sock.close()
    ctx.term()
    out.put((sent, answered))


def ttft_s(url: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion answered {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def phase(url: str, rng: random.Random, size: dict[str, int]) -> float:
    """Median TTFT of size["prompts"] new prompts, one at a time."""
    n = size["prompt_tokens"]
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for _ in range(size["prompts"])]
    return statistics.median(ttft_s(url, p) for p in prompts)


@BENCHES.register("replay_flood")
def replay_flood(quick: bool, model: str | None = None) -> dict[str, Any]:
    from kvstrata.engine.build import resolve_model_path
    from kvstrata.engine.config import EngineConfig
    from kvstrata.serve.process import ServerProcess

    size = QUICK if quick else FULL
    path = resolve_model_path(EngineConfig(model=model or ""))
    pub, replay = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{replay}"
    args = ["--model", str(path), *ENGINE_ARGS]
    args += ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}"]
    args += ["--kv-events-replay-endpoint", endpoint]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(args, Path(tmp) / "server.log")
        try:
            phase(srv.url, rng, {"prompts": 1, "prompt_tokens": 32})  # warm-up
            quiet = phase(srv.url, rng, size)
            spawn = mp.get_context("spawn")
            stop, out = spawn.Event(), spawn.Queue()
            flooder = spawn.Process(target=flood, args=(endpoint, stop, out), daemon=True)
            flooder.start()
            time.sleep(1.0)  # the flood is under way before the first prompt
            flooded = phase(srv.url, rng, size)
            stop.set()
            sent, answered = out.get(timeout=60)
            flooder.join(10)
            quiet2 = phase(srv.url, rng, size)
        finally:
            srv.terminate()
    ratio = flooded / ((quiet + quiet2) / 2)
    return {
        "model": str(path),
        "prompts_per_phase": size["prompts"],
        "prompt_tokens": size["prompt_tokens"],
        "ttft_quiet_s": quiet,
        "ttft_flood_s": flooded,
        "ttft_quiet_after_s": quiet2,
        "flood_over_quiet": ratio,
        "goal": GOAL,
        "meets_goal": ratio <= GOAL,
        "flood_requests_sent": sent,
        "flood_requests_answered": answered,
    }

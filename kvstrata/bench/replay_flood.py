"""`kvstrata bench replay_flood`: TTFT while a subscriber floods the KV events replay socket, over
the quiet TTFT of the same server, in one run.

One `kvstrata serve` (SmolLM2 unless --model) publishes KV events with a replay socket. Phases,
each a series of cold prompts (each new: every one is prefilled and publishes events), one at a
time, streamed: quiet, flood, quiet again. During the flood another process sends replay
requests from seq 0 as fast as its socket takes them (a send waits only while ZMQ's queue is
full) and drains what comes back. The replay socket is served by a thread of its own within a
total budget and a rate per subscriber (kvstrata/serve/event_replay.py): past the budget the
server reads nothing, so the flooder's sends block; it gets a few answers, the engine keeps its
pace. Reports the median TTFT of each phase, flood over the mean of the quiet ones (goal <= 1.2),
the server's CPU seconds per phase and its CPU share idle with and without the flood (the
flood's cost to the server alone), the flooder's requests sent (per second overall, and after
its first second, once the kernel's buffers are full: the pace the server lets it keep),
answered, and its own CPU seconds (it shares the machine: on few cores part of the TTFT ratio
is its CPU), and the replay thread's counters from /metrics.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import psutil
import zmq

from kvstrata.bench.registry import BENCHES
from kvstrata.local_ports import free_port

GOAL = 1.2  # flood TTFT over quiet TTFT
QUICK = {"prompts": 4, "prompt_tokens": 128, "idle_s": 2}
FULL = {"prompts": 16, "prompt_tokens": 1024, "idle_s": 5}
ENGINE_ARGS = ["--page-size", "16", "--device-pages", "512", "--host-pages", "1024"]


@dataclass(frozen=True)
class FloodReport:
    """What the flooder process did (sent back to the bench when it stops)."""

    sent: int  # replay requests its socket took
    sent_first_s: int  # of which in its first second (mostly into the kernel's TCP buffers)
    answered: int  # complete answers it got back
    seconds: float  # how long it flooded
    cpu_s: float  # its own CPU time (user + system)


def flood(endpoint: str, stop: Any, out: Any) -> None:
    """A flooder process: replay requests from seq 0 as fast as the socket takes them, until
    `stop`; puts a FloodReport."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    request, end = (b"", (0).to_bytes(8, "big")), (-1).to_bytes(8, "big", signed=True)
    sent = answered = 0
    first: int | None = None
    t0, cpu0 = time.perf_counter(), time.process_time()
    while not stop.is_set():
        if first is None and time.perf_counter() - t0 >= 1.0:
            first = sent
        events = sock.poll(100, zmq.POLLIN | zmq.POLLOUT)  # waits while the queue is full
        if events & zmq.POLLOUT:
            sent += send_until_full(sock, request)
        while sock.poll(0):
            answered += sock.recv_multipart()[-2] == end
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    report = FloodReport(sent, sent if first is None else first, answered, seconds, cpu)
    sock.close()
    ctx.term()
    out.put(report)


def send_until_full(sock: zmq.Socket, request: tuple[bytes, bytes], most: int = 1000) -> int:
    """Send `request` until the socket's queue is full (or `most` times): how many it took."""
    for n in range(most):
        try:
            sock.send_multipart(request, zmq.NOBLOCK)
        except zmq.Again:
            return n
    return most


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` and its children so far."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        times = p.cpu_times()
        total += times.user + times.system
    return total


REPLAY_COUNTERS = {  # /metrics sample -> the report's name
    'kvstrata:kv_events_replay_requests_total{outcome="answered"}': "replay_answered",
    'kvstrata:kv_events_replay_requests_total{outcome="cut"}': "replay_cut",
    'kvstrata:kv_events_replay_requests_total{outcome="dropped"}': "replay_dropped",
    "kvstrata:kv_events_replay_messages_total": "replay_messages",
    "kvstrata:kv_events_replay_deferrals_total": "replay_deferrals",
    "kvstrata:kv_events_replay_deferred_seconds_total": "replay_deferred_s",
}


def replay_counters(url: str) -> dict[str, float]:
    """The replay thread's counters from the server's /metrics, by short name."""
    got = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in REPLAY_COUNTERS:
            got[REPLAY_COUNTERS[name]] = float(value)
    return got


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


@dataclass
class Phases:
    """What one server did: median TTFT and its CPU seconds per phase, its CPU share idle."""

    ttft_quiet_s: float = 0.0
    ttft_flood_s: float = 0.0
    ttft_quiet_after_s: float = 0.0
    server_cpu_s_quiet_phase: float = 0.0
    server_cpu_s_flood_phase: float = 0.0
    server_cpu_share_idle: float = 0.0  # CPU seconds per second, no request, no flood
    server_cpu_share_idle_flooded: float = 0.0  # the same under the flood: its cost alone


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
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(args, Path(tmp) / "server.log")
        try:
            got, report, counters = run_phases(srv.proc.pid, srv.url, endpoint, size)
        finally:
            srv.terminate()
    ratio = got.ttft_flood_s / ((got.ttft_quiet_s + got.ttft_quiet_after_s) / 2)
    return {
        "model": str(path),
        "prompts_per_phase": size["prompts"],
        "prompt_tokens": size["prompt_tokens"],
        **asdict(got),
        "flood_over_quiet": ratio,
        "goal": GOAL,
        "meets_goal": ratio <= GOAL,
        **{f"flooder_{k}": v for k, v in asdict(report).items()},
        "flooder_sends_per_s": report.sent / report.seconds,
        "flooder_sends_per_s_after_first_s": (report.sent - report.sent_first_s)
        / max(report.seconds - 1.0, 1e-9),
        **counters,
    }


def run_phases(
    pid: int, url: str, endpoint: str, size: dict[str, int]
) -> tuple[Phases, FloodReport, dict[str, float]]:
    """Quiet, flood, quiet again on the server `pid` at `url`; the flooder's report and the
    replay thread's counters after the flood."""
    rng, got = random.Random(0), Phases()
    phase(url, rng, {"prompts": 1, "prompt_tokens": 32})  # warm-up
    got.server_cpu_share_idle = cpu_share(pid, size["idle_s"])
    got.ttft_quiet_s, got.server_cpu_s_quiet_phase = timed_phase(pid, url, rng, size)
    spawn = mp.get_context("spawn")
    stop, out = spawn.Event(), spawn.Queue()
    flooder = spawn.Process(target=flood, args=(endpoint, stop, out), daemon=True)
    flooder.start()
    time.sleep(1.0)  # the flood is under way (the kernel's buffers full) before measuring
    got.server_cpu_share_idle_flooded = cpu_share(pid, size["idle_s"])
    got.ttft_flood_s, got.server_cpu_s_flood_phase = timed_phase(pid, url, rng, size)
    stop.set()
    report: FloodReport = out.get(timeout=60)
    flooder.join(10)
    counters = replay_counters(url)
    got.ttft_quiet_after_s, _ = timed_phase(pid, url, rng, size)
    return got, report, counters


def cpu_share(pid: int, seconds: float) -> float:
    """CPU seconds per second of the server over `seconds` without requests."""
    cpu0 = cpu_s(pid)
    time.sleep(seconds)
    return (cpu_s(pid) - cpu0) / seconds


def timed_phase(
    pid: int, url: str, rng: random.Random, size: dict[str, int]
) -> tuple[float, float]:
    """A phase's median TTFT and the server's CPU seconds over it."""
    cpu0 = cpu_s(pid)
    ttft = phase(url, rng, size)
    return ttft, cpu_s(pid) - cpu0

"""A real `vllm serve` (vLLM's CPU build, in .venv-vllm) for `kvstrata bench vllm` and the tests.

`VllmServer(model, connector=..., ...)` starts it on a free port with greedy-friendly options,
waits for /health within `startup_s` (the error names the log file), and `complete()` streams one
completion by token ids, returning the text, vLLM's cached-token count and the time to the first
token.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.local_ports import PortTaken, free_port, listening_inodes, listens
from kvstrata.serve.process import START_TRIES

ROOT = Path(__file__).resolve().parents[2]
VLLM_BIN = ROOT / ".venv-vllm" / "bin" / "vllm"
CONNECTOR_MODULE = "kvstrata.integrations.vllm.connector"


def kv_transfer_config(extra: dict[str, Any]) -> str:
    """The --kv-transfer-config JSON that loads kvstrata with these extra-config keys."""
    return json.dumps(
        {
            "kv_connector": "KvstrataConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    )


@dataclass
class Completion:
    text: str
    cached_tokens: int
    prompt_tokens: int
    ttft_s: float


class VllmServer:
    """One vLLM server process; use as a context manager."""

    def __init__(
        self,
        model: str | Path,
        log_path: Path,
        connector: dict[str, Any] | None = None,
        num_blocks: int = 16,
        block_size: int = 32,
        max_model_len: int = 384,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        startup_s: float = 420.0,
    ) -> None:
        if not VLLM_BIN.exists():
            raise RuntimeError(
                f"{VLLM_BIN} missing: run scripts/setup_vllm.sh (scripts/test.sh does)"
            )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.startup_s = startup_s
        self.model = str(model)
        args = [
            str(VLLM_BIN), "serve", self.model, "--dtype", "float32", "--port", str(self.port),
            "--enable-prompt-tokens-details", "--block-size", str(block_size),
            "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", str(max_model_len),
            "--max-num-seqs", "4", "--seed", "0", "--enforce-eager", *extra_args,
        ]  # fmt: skip
        if connector is not None:
            args += ["--kv-transfer-config", kv_transfer_config(connector)]
        self.args = args
        self.env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": "1",
            # vLLM's CPU build keeps cores off its workers for its busy-polling scheduler process:
            # one, plus one more whenever a KV connector is set (meant for nixl). On few cores
            # that extra one leaves none, and the worker's OpenMP threads then share both cores
            # with the spinning scheduler (forwards ~2x slower and erratic under load). One
            # reserved core gives vLLM alone and vLLM + kvstrata the same layout.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Until /health answers; a port we picked that another process bound first (between
        our pick and vLLM's bind) is picked again."""
        for attempt in range(1, START_TRIES + 1):
            try:
                self._start_once()
                return
            except PortTaken:
                self.stop()
                if attempt == START_TRIES:
                    raise
                self._move_to(free_port())

    def _move_to(self, port: int) -> None:
        self.args[self.args.index("--port") + 1] = str(port)
        self.port, self.url = port, f"http://127.0.0.1:{port}"

    def _start_once(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if listening_inodes(self.port):  # ours is gone: a neighbour holds the port
                    raise PortTaken(f"port {self.port} is held by another process; vllm exited")
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode} while starting; log: {self.log_path}"
                )
            if self._healthy():
                return
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(
            f"vllm serve not healthy within {self.startup_s} s; log: {self.log_path}"
        )

    def _healthy(self) -> bool:
        """/health answers 200 from vLLM's process or one below it (PortTaken when a neighbour took
        the port between our pick and vLLM's bind: its answer would not be vLLM's)."""
        assert self.proc is not None
        if not listens(self.port, self.proc.pid, tree=True):
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def complete(
        self,
        prompt: list[int],
        max_tokens: int = 8,
        salt: str | None = None,
        timeout_s: float = 300,
    ) -> Completion:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if salt is not None:
            body["cache_salt"] = salt
        req = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.monotonic()
        ttft, parts, usage = 0.0, [], {}
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                payload = line[5:].strip() if line.startswith("data:") else ""
                if not payload.startswith("{"):
                    continue  # blank separators, comments, [DONE]
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"vLLM streamed an error: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    if choice.get("text") and not parts:
                        ttft = time.monotonic() - start
                    parts.append(choice.get("text") or "")
                usage = chunk.get("usage") or usage
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        return Completion("".join(parts), cached, int(usage.get("prompt_tokens", 0)), ttft)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()

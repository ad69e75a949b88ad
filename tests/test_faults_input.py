"""Fault suite, bad input: every command refuses bad input before any work or write,
with one line on stderr naming the option or file, exit code 2 and no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli.main import main

TINY = ["--page-size", "8", "--chunk-tokens", "64", "--max-batch-tokens", "128"]


CKPT = {"seed": 1, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    rows = [
        {"timestamp": i, "input_length": 1024, "output_length": 2, "hash_ids": [i, 99]}
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "error:" in lines[0], err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


RUN_CASES = [
    (["--eviction", "fifo"], ["--eviction", "fifo", "lru"]),
    (["--write-policy", "bogus"], ["--write-policy", "write_through"]),
    (["--prefetch-policy", "nope"], ["--prefetch-policy", "best_effort"]),
    (["--backend", "nccl"], ["--backend nccl", "CUDA"]),
    (["--host-pages", "100000000"], ["--host-pages", "available"]),
    (["--device-pages", "100000000"], ["--device-pages", "available"]),
    (["--page-size", "100000000"], ["--page-size", "positions"]),
    (["--threads", "-1"], ["--threads must be >= 0"]),
    (["--turns", "0"], ["--turns must be >= 1"]),
    (["--cp", "64"], ["64 local ranks", "CPU cores"]),
    (["--storage-url", "ftp://h/d"], ["--storage-url", "scheme"]),
    (["--storage-url", "file:///nonexistent-kv/x/y"], ["--storage-url", "does not exist"]),
    (["--storage-url", "mooncake://127.0.0.1"], ["--storage-url", "HOST:RPC_PORT"]),
]


@pytest.mark.parametrize(("extra", "needles"), RUN_CASES, ids=[c[0][0] for c in RUN_CASES])
def test_run_refuses_before_writing(
    ckpt: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    needles: list[str],
) -> None:
    out = tmp_path / "out"
    assert main(["run", "--quick", "--model", str(ckpt), "--out", str(out), *TINY, *extra]) == 2
    one_line_error(capsys, *needles)
    assert not out.exists()  # validation comes before the first write


def test_run_out_that_is_a_file_or_too_deep(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["run", "--quick", "--model", str(ckpt), "--out", str(afile), *TINY]) == 2
    one_line_error(capsys, "--out", "not a directory")
    deep = tmp_path / "no" / "such" / "out"
    assert main(["run", "--quick", "--model", str(ckpt), "--out", str(deep), *TINY]) == 2
    one_line_error(capsys, "--out", "does not exist")
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("damage", ["no_heads", "truncated", "not_json"])
def test_incomplete_checkpoint_is_named(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    if damage == "no_heads":
        cfg = json.loads((bad / "config.json").read_text())
        del cfg["num_attention_heads"]
        (bad / "config.json").write_text(json.dumps(cfg))
        needles = ["config.json", "num_attention_heads"]
    elif damage == "truncated":
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
        needles = ["model.safetensors", "truncated"]
    else:
        (bad / "config.json").write_text("{nope")
        needles = ["config.json"]
    out = tmp_path / "out"
    assert main(["run", "--quick", "--model", str(bad), "--out", str(out), *TINY]) == 2
    one_line_error(capsys, *needles)
    assert not out.exists()


REPLAY_CASES = [
    (["--max-requests", "0"], ["--max-requests must be >= 1"]),
    (["--max-requests", "-1"], ["--max-requests must be >= 1"]),
    (["--eviction", "fifo"], ["--eviction", "fifo"]),
    (["--model", "gpt"], ["--model", "replay model"]),
    (["--json", "/nonexistent-kv/x/y.json"], ["--json", "does not exist"]),
    (["--storage-url", "ftp://x"], ["--storage-url", "scheme"]),
    (
        ["--device-pages", "1000000000000", "--page-nbytes", "65536"],
        ["--device-pages", "available"],
    ),
]


@pytest.mark.parametrize(
    ("extra", "needles"), REPLAY_CASES, ids=[" ".join(c[0])[:20] for c in REPLAY_CASES]
)
def test_replay_refuses_before_work(
    trace: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needles: list[str]
) -> None:
    assert main(["replay", str(trace), *extra]) == 2
    one_line_error(capsys, *needles)
    assert not Path("/nonexistent-kv").exists()


def test_replay_trace_line_over_the_token_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "big.jsonl"
    n = 5 * 1024 * 1024  # 5M tokens claimed in one line
    row = {"timestamp": 0, "input_length": n, "output_length": 1, "hash_ids": list(range(n // 512))}
    path.write_text(json.dumps(row) + "\n")
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        "big.jsonl:1: input_length 5,242,880 exceeds the limit" in err
        and "--max-input-tokens" in err
    )
    assert "Traceback" not in err


SIMULATE_CASES = [
    (["--hardware", "h100"], ["--hardware", "h100-nvme"]),
    (["--hardware", "h100-nvme", "--eviction", "fifo"], ["--eviction"]),
    (["--hardware", "h100-nvme", "--tp", "0"], ["--tp must be >= 1"]),
    (["--hardware", "h100-nvme", "--max-requests", "0"], ["--max-requests"]),
    (["--hardware", "h100-nvme", "--json", "/nonexistent-kv/x/y.json"], ["--json"]),
]


@pytest.mark.parametrize(
    ("extra", "needles"), SIMULATE_CASES, ids=[c[0][-2] for c in SIMULATE_CASES]
)
def test_simulate_refuses_before_work(
    trace: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needles: list[str]
) -> None:
    assert main(["simulate", str(trace), *extra]) == 2
    one_line_error(capsys, *needles)


def test_bench_and_check_consensus_refuse_before_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "nosuch"]) == 2
    one_line_error(capsys, "nosuch", "radix")
    assert main(["bench", "radix", "--quick", "--json", "/nonexistent-kv/x/y.json"]) == 2
    one_line_error(capsys, "--json")
    assert main(["check-consensus", str(tmp_path), "--json", "/nonexistent-kv/x/y.json"]) == 2
    one_line_error(capsys, "--json")


def test_a_type_error_is_a_bug_with_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """cli/main.py no longer hides TypeError as user input: a bug propagates (traceback)."""
    import kvstrata.cli.bench_cmd as bench_cmd

    def broken(args: object) -> int:
        raise TypeError("a bug")

    monkeypatch.setattr(bench_cmd, "run", broken)
    with pytest.raises(TypeError, match="a bug"):
        main(["bench", "--list"])


def test_trace_ids_2_55_apart_do_not_alias(tmp_path: Path) -> None:
    """The old mapping seeded a block by id * 512 mod 2^64: ids 2^55 apart got the same tokens
    and a trace of distinct ids reported hits. Distinct ids must give exactly 0 hits."""
    path = tmp_path / "t.jsonl"
    rows = [
        {
            "timestamp": i,
            "input_length": 1024,
            "output_length": 1,
            "hash_ids": [i << 55, (i << 55) + 1],
        }
        for i in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    assert main(["replay", str(path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["hit_rate"] == 0.0
    from kvstrata.workloads.trace import TokenMapper

    m = TokenMapper()
    for a, b in ((1, 1 + (1 << 55)), (5, 5 + (1 << 64)), (0, 1 << 70)):
        assert (m.block_tokens(a) != m.block_tokens(b)).mean() > 0.99


def test_run_with_unreachable_redis_writes_nothing(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvstrata.local_ports import refused_port

    out = tmp_path / "out"
    with refused_port() as port:  # bound, never listening: no neighbour's server can take it
        url = f"redis://127.0.0.1:{port}/0"
        assert (
            main(
                ["run", "--quick", "--model", str(ckpt), "--out", str(out), *TINY]
                + ["--storage-url", url]
            )
            == 2
        )
    one_line_error(capsys, url)
    assert not out.exists()


@pytest.mark.parametrize("option", ["--host-pages", "--device-pages"])
def test_serve_refuses_pools_beyond_available_memory(
    ckpt: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    """The same rule as run's, before the engine allocates a pool (and before any port)."""
    assert main(["serve", "--model", str(ckpt), *TINY, option, "100000000"]) == 2
    one_line_error(capsys, option, "available")

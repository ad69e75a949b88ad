"""`kvstrata bench pd`: agent sessions through router + 1 prefill + 1 decode (LocalPD) against the
same load on one `kvstrata serve`, in one run.

Both setups start together (model loads overlap) and get the same token-id prompts
(kvstrata/workloads/agent.py), greedy, interleaved by turn (turn k of every session on P/D, then
on the single server, then turn k+1), so a change of machine load hits both alike. Reported: KV bytes decode received
against the KV bytes of every prompt (`bytes_sent_ratio`; the goal: <= `new_token_share`, the
share of prompt tokens that are new in their turn), per-turn bytes against sending the whole
prefix, whether the pages sent equal the exact count (all pages when cold, then all but the
previous turn's full pages), TTFT p50/p90 of both, prompt tokens each setup computed, and
whether both gave the same text.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from kvstrata.bench.pd_load import Prompts, Turn, drive_rounds, expected_pages, pages, percentile
from kvstrata.bench.registry import BENCHES
from kvstrata.workloads.agent import WorkloadSpec, build_workload

QUICK = WorkloadSpec(sessions=2, turns=3, first_lines=20, tool_lines=8, max_new_tokens=8)
FULL = WorkloadSpec(sessions=4, turns=4, first_lines=60, tool_lines=30, max_new_tokens=16)
PAGE = 16
ENGINE_ARGS = (
    "--page-size", str(PAGE), "--device-pages", "256", "--host-pages", "512",
    "--prefetch-policy", "wait_complete",
)  # fmt: skip
CONCURRENCY = 2


def workload(model_path: Path, spec: WorkloadSpec) -> Prompts:
    """The agent prompts as token ids, through the checkpoint's chat template when it has one."""
    from kvstrata.model.tokenizer import chat_encoder

    vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
    tok = chat_encoder(model_path)
    return build_workload(spec, vocab, tok.encode_chat if tok else None)


@BENCHES.register("pd")
def pd_bench(
    quick: bool,
    sessions: int | None = None,
    concurrency: int | None = None,
    model: str | None = None,
    out: Path | None = None,
) -> dict[str, Any]:
    from kvstrata.engine.build import resolve_model_path
    from kvstrata.engine.config import EngineConfig

    base = QUICK if quick else FULL
    spec = WorkloadSpec(**{**base.__dict__, "sessions": sessions or base.sessions})
    path = resolve_model_path(EngineConfig(model=model or ""))
    prompts = workload(path, spec)
    out_dir = out or Path("kvstrata-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    conc = concurrency or CONCURRENCY
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-pd-") as tmp:
        pd_turns, single_turns, page_bytes = _run_both(path, prompts, spec, conc, out_dir, tmp)
    report = summarize(prompts, pd_turns, single_turns, page_bytes)
    report.update(model=str(path), workload=spec.__dict__, concurrency=conc, page_size=PAGE)
    return report


def _run_both(
    path: Path, prompts: Prompts, spec: WorkloadSpec, conc: int, out_dir: Path, tmp: str
) -> tuple[list[Turn], list[Turn], int]:
    import httpx2 as httpx

    from kvstrata.bench.local_pd import LocalPD, LocalPDConfig

    cfg = LocalPDConfig(
        model=str(path), store_dir=f"{tmp}/pd-storage", log_dir=str(out_dir / "bench-pd-logs"),
        worker_args=ENGINE_ARGS,
    )  # fmt: skip
    single_args = [
        "--model",
        str(path),
        *ENGINE_ARGS,
        "--storage-url",
        f"file://{tmp}/single-storage",
    ]
    pd = LocalPD(cfg)
    single = _start_both(pd, single_args, out_dir / "bench-pd-logs" / "single.log")
    try:
        info = httpx.get(f"{pd.workers['prefill'].url}/v1/pd/info", timeout=30).json()
        urls = [pd.url, single.url]
        pd_turns, single_turns = drive_rounds(urls, prompts, spec.max_new_tokens, conc)
    finally:
        codes = pd.stop()
        codes["single"] = single.terminate()
    if any(codes.values()):
        raise RuntimeError(f"servers did not exit 0: {codes}; logs in {cfg.log_dir}")
    return pd_turns, single_turns, int(info["layout"]["page_bytes"])


def _start_both(pd: Any, single_args: list[str], log: Path) -> Any:
    """LocalPD and the single server, started at the same time (model loads overlap); on a
    failure of either, both are stopped and the error names which one."""
    from concurrent.futures import ThreadPoolExecutor

    from kvstrata.serve.process import ServerProcess

    log.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(2) as pool:
        f_pd = pool.submit(pd.start)
        f_single = pool.submit(ServerProcess, single_args, log, pd.cfg.start_timeout_s)
        errors = {"P/D": f_pd.exception(), "single server": f_single.exception()}
    if not any(errors.values()):
        return f_single.result()
    pd.stop()
    if errors["single server"] is None:
        f_single.result().stop()
    name, exc = next((k, e) for k, e in errors.items() if e is not None)
    raise RuntimeError(f"bench pd: the {name} did not start: {exc}") from exc


def summarize(
    prompts: Prompts, pd: list[Turn], single: list[Turn], page_bytes: int
) -> dict[str, Any]:
    """The report's figures; `pd` and `single` sorted by (session, turn) like `prompts`."""
    lens = [[len(p) for p in s] for s in prompts]
    prompt_tokens = sum(map(sum, lens))
    new_tokens = sum(s[0] + sum(b - a for a, b in zip(s, s[1:], strict=False)) for s in lens)
    whole = sum(pages(n, PAGE) for s in lens for n in s) * page_bytes
    sent = sum(t.pd["bytes_received"] for t in pd)
    want = [n for row in expected_pages(prompts, PAGE) for n in row]
    got = [t.pd["pages_received"] for t in pd]
    turns = max(len(s) for s in prompts)
    by_turn = [[t for t in pd if t.turn == k] for k in range(turns)]
    return {
        "bytes_sent_ratio": sent / whole,
        "new_token_share": new_tokens / prompt_tokens,
        "outputs_identical": [t.text for t in pd] == [t.text for t in single],
        "ttft_p50_s_pd": percentile([t.ttft_s for t in pd], 0.5),
        "ttft_p50_s_single": percentile([t.ttft_s for t in single], 0.5),
        "ttft_p90_s_pd": percentile([t.ttft_s for t in pd], 0.9),
        "ttft_p90_s_single": percentile([t.ttft_s for t in single], 0.9),
        "prefill_tokens_computed_pd": sum(t.pd["prefill_computed_tokens"] for t in pd),
        "prefill_tokens_computed_single": sum(_computed(t) for t in single),
        "bytes_sent": sent,
        "bytes_whole_prompts": whole,
        "page_bytes": page_bytes,
        "pages_sent": sum(got),
        "pages_expected": sum(want),
        "pages_exact": got == want,
        "pages_skipped": sum(t.pd["pages_skipped"] for t in pd),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "requests": len(pd),
        "bytes_sent_by_turn": [sum(t.pd["bytes_received"] for t in ts) for ts in by_turn],
        "bytes_whole_prefix_by_turn": [
            sum(pages(t.prompt_tokens, PAGE) for t in ts) * page_bytes for ts in by_turn
        ],
        "new_token_share_by_turn": _share_by_turn(lens, turns),
    }


def _share_by_turn(lens: list[list[int]], turns: int) -> list[float]:
    """Per turn index: tokens new in that turn / its prompt tokens, over the sessions."""
    out = []
    for k in range(turns):
        rows = [s for s in lens if len(s) > k]
        new = sum(s[k] - (s[k - 1] if k else 0) for s in rows)
        out.append(new / sum(s[k] for s in rows))
    return out


def _computed(t: Turn) -> int:
    """Prompt tokens a single server computed: the prompt less what its cache served."""
    details = t.usage.get("prompt_tokens_details") or {}
    return int(t.usage["prompt_tokens"]) - int(details.get("cached_tokens") or 0)

"""`kvstrata bench agent` end to end on a tiny random Llama (the --quick run needs SmolLM2 and
minutes): three servers a round, the three arms in two rounds, and the report's keys and pin
figures over both."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvstrata.bench.agent import PAGE_COUNTERS, PREFETCH_OUTCOMES, paired_ttft_ratio, run_agent
from kvstrata.bench.agent_load import AgentSpec, ArmResult, Turn
from kvstrata.workloads.turn_gaps import GapSampler

CKPT = {"seed": 8, "max_position_embeddings": 2048}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""

SPEC = AgentSpec(
    sessions=2, hinted_sessions=1, turns=2, unhinted_turns=2, map_lines=2, first_lines=2,
    unhinted_first_lines=3, tool_lines=1, max_tokens=2, gap_scale=1.0, gap_cap_s=0.2,
    start_every_s=0.1, hinted_start_s=0.1, page_size=32, device_pages=64, host_pages=96,
    storage_read_s_per_page=0.01, rounds=2,
)  # fmt: skip


@pytest.mark.slow
def test_three_arms_in_two_rounds_report_their_ratios_and_pins(ckpt: Path, tmp_path: Path) -> None:
    sampler = GapSampler([0.05, 0.1, 0.3], SPEC.gap_scale, SPEC.gap_cap_s, 0)
    report = run_agent(SPEC, ckpt, sampler, tmp_path)
    assert report["errors"] == 0, [report[a]["error_messages"] for a in ("none", "pins")]
    for key in ("ttft_p90_pins_over_none", "ttft_p50_pins_prefetch_over_none",
                "unhinted_ttft_over_none", "unhinted_ttft_paired_over_none"):  # fmt: skip
        assert not math.isnan(report[key]) and report[key] > 0, key
    none, pins, both = report["none"], report["pins"], report["pins_prefetch"]
    # two rounds of 2 sessions x 2 turns, pooled per arm
    assert none["requests"] == pins["requests"] == both["requests"] == 8
    assert [row[:2] for row in none["turn_log"]] == ["r0"] * 4 + ["r1"] * 4
    assert none["pins_made"] == 0 and none["pinned_tokens_reported"] == 0
    # session 1 is hinted: its 2 turns pin their histories (nested: each a new pin), per round
    assert pins["pins_made"] == both["pins_made"] == 4 and pins["pinned_tokens_reported"] > 0
    assert both["hints_sent"] == 2 and pins["hints_sent"] == 0  # one hinted tool call a round
    assert len(pins["pinned_pages_end"]) == 2  # each round's server at its end
    assert set(both["hit_rate_by_tier"]) == {"device", "host", "storage"}
    for arm in (none, pins, both):  # read from /metrics: the pools hold every page, no reload
        assert [arm[f"reloads_{o}"] for o in PREFETCH_OUTCOMES] == [0] * 4
        assert [arm[name] for name in PAGE_COUNTERS] == [0, 0]
    for arm in (none, pins, both):
        assert arm["hinted"]["turns"] == arm["unhinted"]["turns"] == 4
        for who in ("hinted", "unhinted"):  # each session's second turn finds its first
            src = arm[who]["prompt_tokens_from"]
            assert src["device"] + src["host"] + src["storage"] > 0 and src["computed"] > 0
            assert 0 <= src["history_computed"] <= src["computed"]
        assert 0 <= arm["in_flight_max"] <= 1  # two sessions: at most the other one
    assert "0.01 s" in report["storage"]


def test_a_hinted_sessions_tool_calls_run_hinted_gap_x_times_the_drawn_gap() -> None:
    spec = AgentSpec(**{**SPEC.__dict__, "hinted_gap_x": 3.0})
    sampler = GapSampler([0.05, 0.1, 0.3], 1.0, 10.0, 0)
    for turn in range(4):
        drawn = sampler.gap(0, turn), sampler.gap(1, turn)
        assert spec.tool_gap_s(sampler, 0, turn) == drawn[0]  # session 0 sends no hints
        assert spec.tool_gap_s(sampler, 1, turn) == 3.0 * drawn[1]
    with pytest.raises(ValueError, match="hinted_gap_x must be > 0, got 0"):
        AgentSpec(**{**SPEC.__dict__, "hinted_gap_x": 0.0})


def test_the_paired_ratio_compares_each_turn_with_itself_in_the_no_hints_arm() -> None:
    def arm(ttfts: dict[tuple[int, int, int], float], hinted: bool = False) -> ArmResult:
        out = ArmResult()
        for (round_, session, turn), ttft in ttfts.items():
            out.turns.append(Turn(session, turn, hinted, ttft, 100, {}, 0, round=round_))
        return out

    none = arm({(0, 0, 0): 1.0, (0, 0, 1): 2.0, (0, 1, 0): 4.0, (1, 0, 0): 0.5})
    # per turn: 3.0, 1.0, 0.5, 2.0 (sorted 0.5, 1.0, 2.0, 3.0: the upper median, as _pct)
    pins = arm({(0, 0, 0): 3.0, (0, 0, 1): 2.0, (0, 1, 0): 2.0, (1, 0, 0): 1.0})
    assert paired_ttft_ratio(pins, none, hinted=False) == 2.0
    # turns of the other group, or with no partner in the no-hints arm, count for nothing
    pins.turns += arm({(0, 2, 0): 9.0}).turns + arm({(0, 0, 0): 9.0}, hinted=True).turns
    assert paired_ttft_ratio(pins, none, hinted=False) == 2.0
    assert math.isnan(paired_ttft_ratio(pins, none, hinted=True))

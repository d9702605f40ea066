"""`pdserve bench --repeat`: the rounds' order, each configuration's medians and its ratios to
local."""

import pytest

from deploy.bench.repeats import median_lines, repeat_lines, rounds


def line(mode: str, r: int, tok_s: float, slots: int = 4) -> dict:
    return {
        "mode": mode,
        "round": r,
        "slots": slots,
        "token_budget": 64,
        "rate": 0.0,
        "priorities": True,
        "prefix_cache": True,
        "cache_routing": True,
        "output_tok_s": tok_s,
        "ttft_ms_p50": 10.0 * (r + 1),
    }


def test_every_other_round_runs_the_configurations_in_reverse():
    assert list(rounds(["a", "b", "c"], 3)) == [
        (0, "a"),
        (0, "b"),
        (0, "c"),
        (1, "c"),
        (1, "b"),
        (1, "a"),
        (2, "a"),
        (2, "b"),
        (2, "c"),
    ]
    assert list(rounds(["a"], 1)) == [(0, "a")]
    with pytest.raises(ValueError):
        list(rounds(["a"], 0))


def test_ratios_to_local_pair_runs_of_the_same_round_and_medians_ignore_outliers():
    summaries = [
        line("local", 0, 100.0),
        line("colocated", 0, 80.0),
        line("colocated", 1, 45.0),
        line("local", 1, 50.0),
        line("local", 2, 110.0),
        line("colocated", 2, 99.0),
        # another configuration: no local run with its settings
        line("colocated", 0, 7.0, slots=8),
    ]
    local, colocated, other = repeat_lines(summaries)
    assert local["repeat"] == "local" and "output_tok_s_over_local" not in local
    assert colocated["rounds"] == 3 and colocated["output_tok_s"] == {
        "median": 80.0,
        "min": 45.0,
        "max": 99.0,
    }
    # each round against its own local run
    assert colocated["output_tok_s_over_local"] == [0.8, 0.9, 0.9]
    assert colocated["median_over_median_local"] == 0.8  # 80 / 100
    assert colocated["ttft_ms_p50"] == {"median": 20.0, "min": 10.0, "max": 30.0}
    assert other["slots"] == 8 and "output_tok_s_over_local" not in other
    assert sorted(s["output_tok_s"] for s in median_lines(summaries)) == [7.0, 80.0, 100.0]

"""The GPU-cost simulation: the cost model's arithmetic, the trace and its load, the figure, and a
short shifting trace through the real scheduler and planner on Ray with no request lost."""

import json

import pytest

from benchmarks.gpu_sim import by_day, main, run, summarize
from benchmarks.pool_floor import pool_floor
from benchmarks.traces import (
    DAILY_PHASES,
    SHIFTING_PHASES,
    days_trace,
    offered_load,
    shifting_trace,
)
from deploy.bench.cost_model import A10_LLAMA_8B, CostModel
from scheduler.plan import Chunk, StepPlan

MODEL = CostModel("toy", 0.010, 0.001, 1e-6, 0.020, 0.002, 1e-5, 100, 10_000, 1e9, "by hand")


def chunk(req_id, tokens, start):
    return Chunk(req_id, [0], [1] * tokens, start, True, 0, None)


def test_step_times_follow_the_cost_model():
    prefill = StepPlan(decode=[], prefill=[chunk("a", 100, 0), chunk("b", 50, 200)])
    pairs = 100 * 50 + 50 * (200 + 25)  # each token attends to the context before it
    assert MODEL.step_s(prefill) == pytest.approx(0.010 + 0.001 * 150 + 1e-6 * pairs)
    decode = StepPlan(decode=[chunk("a", 1, 99), chunk("b", 1, 9)], prefill=[])
    assert MODEL.step_s(decode) == pytest.approx(0.020 + 0.002 * 2 + 1e-5 * (100 + 10))
    # one forward reads the weights once: a mixed step pays one fixed cost
    mixed = StepPlan(decode=[chunk("a", 1, 99)], prefill=[chunk("b", 10, 0)])
    assert MODEL.step_s(mixed) == pytest.approx(
        0.010 + 0.001 * 10 + 1e-6 * 10 * 5 + 0.002 + 1e-5 * 100
    )
    # the A10 figures: the weights' read dominates a small decode step (about 33 ms)
    small = StepPlan(decode=[chunk("a", 1, 511)], prefill=[])
    assert 0.033 < A10_LLAMA_8B.step_s(small) < 0.035


def test_the_shifting_trace_moves_through_its_phases():
    phases = [((2.0, 2.0), (1000, 2000), (10, 20)), ((1.0, 1.0), (10, 20), (300, 400))]
    trace = shifting_trace(2.0, seed=1, phases=phases)
    first = [a for a in trace if a[0] < 60]
    second = [t for t in trace if t[0] >= 60]
    assert 90 < len(first) < 150 and 40 < len(second) < 80  # Poisson at 2/s, then 1/s
    assert all(p >= 1000 and o <= 20 for _, p, o in first)
    assert all(p <= 20 and o >= 300 for _, p, o in second)


def test_a_phase_s_rate_moves_from_its_start_to_its_end():
    trace = shifting_trace(4.0, seed=3, phases=[((0.5, 4.5), (10, 20), (10, 20))])
    quarters = [sum(q * 60 <= t < (q + 1) * 60 for t, _, _ in trace) for q in range(4)]
    # expected 60 x (1.0, 2.0, 3.0, 4.0) arrivals; Poisson noise is about 8-16
    for count, expected in zip(quarters, (60, 120, 180, 240), strict=True):
        assert abs(count - expected) < 0.25 * expected + 10
    assert quarters == sorted(quarters)


@pytest.mark.slow
def test_a_short_trace_through_the_planner_loses_nothing(ray_session):
    phases = [((3.0, 3.0), (1500, 2500), (8, 16)), ((1.0, 1.0), (50, 100), (100, 200))]
    trace = shifting_trace(0.5, seed=2, phases=phases)
    result = run(trace, 2, 2, True, A10_LLAMA_8B, 0.5, 2.0, 0.08, window_s=5.0)
    line = summarize(result, 0.5, 5.0)
    assert line["requests"] == len(trace) and line["lost"] == 0
    assert line["pools"] and all(p["prefill"] + p["decode"] == 4 for p in line["pools"])
    assert 0 < line["goodput_req_s"] and len(line["goodput_per_window"]) == 7
    assert {"prefill", "decode"} <= set(line["timeline"])  # where each kind's step time went


def test_days_repeat_the_trace_each_drawn_afresh_and_are_reported_one_by_one():
    phases = [((2.0, 2.0), (10, 20), (5, 6))]
    trace = days_trace(1.0, seed=4, phases=phases, days=2)
    first = [a for a in trace if a[0] < 60]
    second = [(t - 60, p, o) for t, p, o in trace if t >= 60]
    assert first == shifting_trace(1.0, 4, phases)
    again = shifting_trace(1.0, 5, phases)
    assert [(p, o) for _, p, o in second] == [(p, o) for _, p, o in again]
    assert [t for t, _, _ in second] == pytest.approx([t for t, _, _ in again])
    requests = [
        {"arrival_s": 10.0, "ok": True, "good": True},
        {"arrival_s": 70.0, "ok": True, "good": False},
        {"arrival_s": 80.0, "ok": False, "good": False},
    ]
    # 3 workers for the first 90 s, 2 until the last answer at 130 s
    pools = [{"at_s": 0.0, "prefill": 2, "decode": 1}, {"at_s": 90.0, "prefill": 1, "decode": 1}]
    pools.append({"at_s": 130.0, "prefill": 1, "decode": 1})
    days = by_day({"requests": requests, "pools": pools}, 1.0, 2)
    assert [d["requests"] for d in days] == [1, 2] and [d["lost"] for d in days] == [0, 1]
    assert [d["goodput_req_s"] for d in days] == [round(1 / 60, 3), 0.0]
    assert [d["worker_seconds"] for d in days] == [180.0, 30 * 3 + 40 * 2]


def test_the_offered_load_counts_each_arrival_in_its_window():
    trace = [(0.5, 100, 10), (9.9, 300, 30), (10.0, 50, 500), (25.0, 7, 7)]
    load = offered_load(trace, minutes=0.5, window_s=10.0)
    assert load["prompt_tok_s"] == [40.0, 5.0, 0.7, 0.0]
    assert load["output_tok_s"] == [4.0, 50.0, 0.7, 0.0]


def test_the_figure_is_drawn_from_saved_runs_without_running_any(tmp_path):
    def line(split, planner, sizes):
        pools = [{"at_s": 10.0 * i, "prefill": p, "decode": d} for i, (p, d) in enumerate(sizes)]
        return {
            "split": split,
            "planner": planner,
            "goodput_req_s": 1.0,
            "goodput_per_window": [1.0] * len(sizes),
            "pools": pools,
            "role_changes": 0,
            "worker_seconds": 40.0 * len(sizes),
        }

    runs = tmp_path / "runs.jsonl"
    lines = [line("3:1", False, [(3, 1)] * 4), line("2:2", True, [(2, 2), (3, 1), (3, 1), (1, 3)])]
    runs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    figure = tmp_path / "pools.png"
    args = ["--splits", "", "--minutes", "0.5", "--window-s", "10", "--output", str(runs)]
    assert main([*args, "--plot", str(figure)]) == 0
    assert figure.stat().st_size > 10_000
    assert main(["--splits", "", "--plot", str(tmp_path / "none.png")]) == 2
    # runs of one trace are not drawn against another's load
    runs.write_text(json.dumps(line("3:2", False, [(3, 2)] * 4) | {"trace": "daily"}) + "\n")
    assert main([*args, "--plot", str(tmp_path / "daily.png")]) == 2
    assert main([*args, "--trace", "daily", "--plot", str(tmp_path / "daily.png")]) == 0


def test_the_floor_sizes_each_phase_of_a_steady_trace_as_the_planner_would():
    """The shifting trace's phases need 3:1, 1:2 and 3:1 (its arithmetic in gpu_sim), so the floor
    is four, three and four workers for four minutes each, plus a start-up for each worker the
    next phase adds (one decode, then two prefill), against 3:2 throughout."""
    floor = pool_floor(SHIFTING_PHASES, 12, A10_LLAMA_8B, 2.0, 0.06, 10.0)
    assert floor["pools"] == [(3, 1)] * 24 + [(1, 2)] * 24 + [(3, 1)] * 24
    assert floor["starts"] == 3 and floor["fixed"] == "3:2"
    assert floor["worker_seconds"] == (4 + 3 + 4) * 240 + 3 * A10_LLAMA_8B.startup_s
    assert floor["ratio_to_fixed"] == round(floor["worker_seconds"] / (5 * 720), 3)
    # a 30 s release delay keeps each phase's pools three windows into the next
    held = pool_floor(SHIFTING_PHASES, 12, A10_LLAMA_8B, 2.0, 0.06, 10.0, release_delay_s=30)
    assert held["pools"][24:27] == held["pools"][48:51] == [(3, 2)] * 3
    assert held["pools"][27] == (1, 2) and held["pools"][51] == (3, 1)
    assert held["worker_seconds"] == floor["worker_seconds"] + (2 + 1) * 30


def test_the_floor_follows_a_rising_load_and_stays_within_the_bounds():
    floor = pool_floor(DAILY_PHASES, 12, A10_LLAMA_8B, 2.0, 0.06, 10.0)
    first = [p for p, _ in floor["pools"][:12]]  # prompt-heavy, 0.75 -> 3 req/s
    assert first == sorted(first) and first[0] < first[-1]
    assert floor["ratio_to_fixed"] < 1
    bounded = pool_floor(DAILY_PHASES, 12, A10_LLAMA_8B, 2.0, 0.06, 10.0, bounds=(2, 1))
    assert all(p <= 2 and d <= 1 for p, d in bounded["pools"]) and bounded["fixed"] == "2:1"
    assert bounded["worker_seconds"] < floor["worker_seconds"]


def test_floor_prints_without_running_anything(capsys):
    assert main(["--trace", "daily", "--floor", "--scaling", "3:2", "--window-s", "10"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["trace"] == "daily" and line["floor"]["fixed"] == "3:2"


def test_a_forecast_without_pools_that_scale_or_a_day_to_learn_from_is_refused(capsys):
    for args in (["--days", "2"], ["--scaling", "3:2"]):
        with pytest.raises(SystemExit) as refused:
            main(["--splits", "", "--forecast", *args])
        assert refused.value.code == 2
        assert "--forecast needs --scaling and --days 2 or more" in capsys.readouterr().err

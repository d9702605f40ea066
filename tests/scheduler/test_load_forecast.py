"""The seasonal forecast and the pool planner that follows it: what the last period saw, pooled
and scaled to today's level, and pools sized a start-up ahead of a load that comes back."""

import pytest

from scheduler.load_forecast import SeasonalForecast
from scheduler.load_window import LoadWindow
from scheduler.pool_planner import PoolPlanner, Speeds


def load(rate, prompt=2000, output=20, seconds=10.0):
    n = round(rate * seconds)
    return LoadWindow(
        seconds=seconds,
        arrivals=n,
        prompt_tokens=n * prompt,
        prompt_tokens_sq=n * prompt**2,
        finished=n,
        output_tokens=n * output,
    )


def day(rates):
    """A period of 10 s windows at these rates."""
    return [load(rate) for rate in rates]


def test_nothing_is_forecast_before_a_whole_period_has_been_seen():
    forecast = SeasonalForecast(period_s=100.0)
    for window in day([1] * 9):
        forecast.record(window)
    assert forecast.ahead(30.0) == []
    forecast.record(load(1))
    pooled = [e.rate for e in forecast.ahead(30.0)][::2]
    assert pooled == pytest.approx([1.0, 1.0, 1.0])


def test_the_forecast_is_the_last_period_s_windows_ahead_pooled_with_their_neighbours():
    forecast = SeasonalForecast(period_s=100.0, level_s=40.0)
    rates = [1, 1, 1, 1, 1, 1, 4, 4, 1, 1]
    for window in day(rates) + day(rates[:5]):
        forecast.record(window)
    # now 50 s into the second period: the next 30 s a period ago were windows 5, 6 and 7
    expected = forecast.ahead(30.0)
    assert [e.in_s for e in expected] == [10.0, 10.0, 20.0, 20.0, 30.0, 30.0]
    # each pooled with its neighbours: (1 + 1 + 4) / 3, (1 + 4 + 4) / 3, (4 + 4 + 1) / 3
    assert [e.rate for e in expected[::2]] == pytest.approx([2.0, 3.0, 3.0])
    # and alone, at the lower end of its count: 10 - 1.28 sqrt(10), 40 - 1.28 sqrt(40) in 10 s
    low = [(n - 1.28 * n**0.5) / 10 for n in (10, 40, 40)]
    assert [e.rate for e in expected[1::2]] == pytest.approx(low)
    assert expected[0].mean_prompt == 2000 and expected[0].prompt_spread == pytest.approx(0.0)
    assert expected[0].mean_output == 20
    assert forecast.level == pytest.approx(1.0)


def test_the_forecast_follows_today_s_level():
    forecast = SeasonalForecast(period_s=100.0, level_s=40.0)
    for window in day([1] * 10) + day([2] * 5):  # today twice as busy as a period ago
        forecast.record(window)
    # (80 + 1) / (40 + 1): the level of the last 40 s against the same 40 s a period ago
    assert forecast.ahead(10.0)[0].rate == pytest.approx(81 / 41)  # pooled, at that level
    surge = SeasonalForecast(period_s=100.0, level_s=40.0)
    for window in day([1] * 10) + day([9] * 4):
        surge.record(window)
    assert surge.ahead(10.0)[0].rate == pytest.approx(2.0)  # at most twice


def test_a_level_from_a_few_arrivals_a_period_ago_is_not_trusted():
    # the period began quiet (a server started before its clients): 0.2 req/s, 8 arrivals in
    # the 40 s before the window ahead; today the same 40 s saw 40: no sign of a day 4.6x busier
    forecast = SeasonalForecast(period_s=100.0, level_s=40.0)
    for window in day([0.2] * 4 + [3] * 6) + day([1] * 4):
        forecast.record(window)
    assert forecast.ahead(10.0)[0].rate == pytest.approx((2 + 30 + 30) / 30)  # at level 1
    assert forecast.level == 1.0


def test_only_a_period_and_the_level_s_span_are_kept():
    forecast = SeasonalForecast(period_s=100.0, level_s=40.0)
    for window in day([1] * 30):
        forecast.record(window)
    assert len(forecast.seen) == 14  # 140 s of 10 s windows


def planner():
    speeds = Speeds(prefill_tok_s=10_000, decode_fixed_s=0.010, decode_per_seq_s=0.001)
    return PoolPlanner(
        slo_itl_s=0.040,
        decode_slots=64,
        speeds=speeds,
        total=None,
        max_prefill=4,
        release_after=3,
        forecast=SeasonalForecast(period_s=200.0, level_s=40.0),
        startup_s=30.0,
    )


# 2,000-token prompts at 10,000 tok/s, workers kept under 80%: 0.5 req/s needs one prefill
# worker, 10 req/s three (2.5)
QUIET, BUSY = 0.5, 10
RATES = [QUIET] * 10 + [BUSY] * 5 + [QUIET] * 5


def follow(p, windows, pools):
    """Feed the windows; apply each decision at once; the pools after each window."""
    seen = []
    for window in windows:
        target = p.decide(window, prefill=pools[0], decode=pools[1])
        if target is not None:
            pools = (target.prefill, target.decode)
        seen.append(pools)
    return seen


def test_a_load_the_last_period_saw_is_met_a_start_up_ahead():
    p = planner()
    first = follow(p, day(RATES), (1, 1))
    # the first period: the planner learns of the busy windows when they come (window 10)
    assert first[9][0] == 1 and first[10][0] == 3
    second = follow(p, day(RATES[:10]), first[-1])
    # the second: the next 40 s (a start-up and a window) reach window 10 from window 6 on: the
    # workers started then answer when the load comes
    assert [pools[0] for pools in second[4:8]] == [1, 1, 3, 3]


def test_a_worker_is_released_at_once_when_the_last_period_says_the_load_stays_low():
    p = planner()
    follow(p, day(RATES), (1, 1))
    pools = follow(p, day(RATES[:15]), (1, 1))
    assert pools[-1][0] == 3
    # the busy windows end; a period ago the load stayed low after them: one released a window,
    # with no release delay (without the forecast, three low windows must pass first)
    after = follow(p, day(RATES[15:17]), pools[-1])
    assert [a[0] for a in after] == [2, 1]


def test_a_worker_the_last_period_needed_again_within_a_start_up_is_kept():
    rates = [BUSY] * 5 + [QUIET] * 3 + [BUSY] * 5 + [QUIET] * 7  # a dip of 30 s
    p = planner()
    first = follow(p, day(rates), (3, 1))
    # without a forecast, three quiet windows running release one: the load's return is unknown
    assert [pools[0] for pools in first[4:9]] == [3, 3, 3, 2, 3]
    second = follow(p, day(rates[:8]), first[-1])
    # with it, the dip is kept through: the load comes back within a start-up and a window
    assert [pools[0] for pools in second[4:8]] == [3, 3, 3, 3]


def test_a_load_above_the_last_period_s_by_more_than_noise_is_met_at_once():
    p = planner()
    follow(p, day([QUIET] * 20), (1, 1))
    target = p.decide(load(12), prefill=1, decode=1)
    # 120 arrivals in 10 s: at the lower end of their rate, 10.6 req/s, 2.65 workers
    assert target.prefill == 3
    assert "lower end of its arrivals 3:1" in target.reason


def test_a_forecast_window_brings_the_speeds_measured_on_its_mix():
    measured = load(2)  # 2 req/s of 2,000-token prompts, prefilled at 4,000 tok/s
    measured.prefill_tokens, measured.prefill_busy_s = 40_000, 10.0
    measured.decode_steps = [(1, 0.011), (11, 0.021), (21, 0.031)]
    p = planner()
    p.speeds = Speeds(prefill_tok_s=4_000, decode_fixed_s=0.010, decode_per_seq_s=0.001)
    follow(p, [measured] * 20, (1, 1))
    [expected, *_] = p.forecast.ahead(10.0)
    assert expected.prefill_tok_s == 4_000
    assert expected.decode_fit == pytest.approx((0.010, 0.001))
    # today's short prompts were prefilled at 2,000 tok/s: the long prompts a period ago are
    # sized at their own speed, 2 x 0.5 s = 1.0 of a worker's time, 2 workers at 80% (at
    # today's speed they would need 3)
    short = load(2, prompt=200)
    short.prefill_tokens, short.prefill_busy_s = 4_000, 2.0
    target = p.decide(short, prefill=1, decode=1)
    assert (target.prefill, target.decode) == (2, 1)
    assert p.needs_at(2, 2000, 0.0, 20)[0] == pytest.approx(2.5)


def test_windows_timed_on_a_large_clock_make_a_whole_period():
    """Seven 10 s windows measured as differences of time.monotonic() values make 70 s."""
    forecast = SeasonalForecast(period_s=70)
    start = 131_027.5367342554  # its seven differences sum to 69.99999999998545
    for i in range(7):
        begin, end = start + 10 * i, start + 10 * (i + 1)
        forecast.record(LoadWindow(seconds=end - begin, arrivals=1))
    assert forecast.ready()

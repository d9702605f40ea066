"""The pool planner's arithmetic: measured speeds, the needs of a window's load, the split it
asks for, and its hysteresis."""

import heapq
import random

import pytest

from scheduler.load_window import LoadWindow
from scheduler.pool_planner import PoolPlanner, Speeds, fit_line, held_load


def test_a_line_is_fitted_to_step_times():
    d, e = fit_line([(1, 0.011), (8, 0.018), (32, 0.042), (16, 0.026)])
    assert d == pytest.approx(0.010, abs=1e-9) and e == pytest.approx(0.001, abs=1e-9)
    assert fit_line([(4, 0.01), (4, 0.02)]) is None  # one batch size: no slope to see


def test_speeds_are_measured_from_a_window_and_kept_through_one_without_steps():
    speeds = Speeds()
    window = LoadWindow(prefill_tokens=20_000, prefill_busy_s=2.0)
    window.decode_steps = [(b, 0.010 + 0.001 * b) for b in (1, 4, 16, 32)]
    speeds.observe(window)
    assert speeds.prefill_tok_s == 10_000
    assert speeds.decode_fixed_s == pytest.approx(0.010)
    assert speeds.decode_per_seq_s == pytest.approx(0.001)
    speeds.observe(LoadWindow())
    assert speeds.prefill_tok_s == 10_000
    # the batch whose step stays under a 40 ms ITL: 30 sequences (capped by the slots)
    assert speeds.decode_batch(0.040, max_batch=64) == 30
    assert speeds.decode_batch(0.040, max_batch=16) == 16
    assert speeds.decode_tok_s(30) == pytest.approx(30 / 0.040)


def planner(**kw):
    speeds = Speeds(prefill_tok_s=10_000, decode_fixed_s=0.010, decode_per_seq_s=0.001)
    return PoolPlanner(slo_itl_s=0.040, decode_slots=64, speeds=speeds, **kw)


def load(rate, prompt, output, seconds=10.0):
    n = int(rate * seconds)
    return LoadWindow(
        seconds=seconds,
        arrivals=n,
        prompt_tokens=n * prompt,
        finished=n,
        output_tokens=n * output,
    )


def test_needs_follow_the_load():
    p = planner(total=8)
    # 10 req/s x 2,000 prompt tokens = 20,000 tok/s of prefill: 2 workers at 100%, 2.5 at 80%;
    # 10 req/s x 100 output tokens = 1,000 tok/s of decode; one worker: 30 / 0.040 = 750 tok/s
    prefill, decode = p.needs(load(10, 2000, 100))
    assert prefill == pytest.approx(2.5) and decode == pytest.approx(1000 / 750 / 0.8)


def test_a_fixed_total_is_split_by_need_after_the_target_persists():
    p = planner(total=4)
    heavy_prompts = load(10, 2000, 20)
    assert p.decide(heavy_prompts, prefill=1, decode=3) is None  # seen once
    target = p.decide(heavy_prompts, prefill=1, decode=3)
    assert (target.prefill, target.decode) == (2, 2)  # one worker per decision
    assert p.decide(heavy_prompts, prefill=2, decode=2) is None  # and then wait for it again
    target = p.decide(heavy_prompts, prefill=2, decode=2)
    assert (target.prefill, target.decode) == (3, 1)
    # the decode pool keeps its minimum however prompt-heavy the load
    for _ in range(3):
        assert p.decide(heavy_prompts, prefill=3, decode=1) is None


def test_a_change_of_mind_restarts_the_patience():
    p = planner(total=4)
    assert p.decide(load(10, 2000, 20), prefill=2, decode=2) is None
    assert p.decide(load(2, 50, 800), prefill=2, decode=2) is None  # now it wants decode
    target = p.decide(load(2, 50, 800), prefill=2, decode=2)
    assert (target.prefill, target.decode) == (1, 3)


def test_with_scaling_each_pool_is_sized_to_its_need_within_bounds():
    p = planner(total=None, max_decode=4)
    window = load(10, 2000, 400)  # prefill 2.5 -> 3; decode 4000 / 750 / 0.8 = 6.7 -> max 4
    target = p.decide(window, prefill=1, decode=1)
    # every start at once, and on the first window that needs it: a start answers a start-up
    # later, and waiting a window on a rising load only adds to the prompts queued meanwhile
    assert (target.prefill, target.decode) == (3, 4)


def test_with_a_fixed_total_a_role_change_still_waits_for_its_patience():
    p = planner(total=4)
    window = load(10, 2000, 20)
    assert p.decide(window, prefill=1, decode=3) is None
    assert (p.decide(window, prefill=1, decode=3).prefill) == 2


def test_with_scaling_a_pool_that_grows_takes_the_worker_the_other_gives_up():
    p = planner(total=None, max_prefill=4, max_decode=4)
    chatty = load(2, 50, 700)  # prefill 0.01 -> 1; decode 1400 / 750 / 0.8 = 2.3 -> 3
    for prefill, decode, after in [(3, 1, (2, 2)), (2, 2, (1, 3))]:
        assert p.decide(chatty, prefill=prefill, decode=decode) is None  # a role change waits
        target = p.decide(chatty, prefill=prefill, decode=decode)
        assert (target.prefill, target.decode) == after  # a role change: the total stays
    p.decide(chatty, prefill=2, decode=3)
    target = p.decide(chatty, prefill=2, decode=3)
    assert (target.prefill, target.decode) == (1, 3)  # only prefill has a spare: released
    idle = load(0.1, 50, 20)
    p.decide(idle, prefill=3, decode=3)
    target = p.decide(idle, prefill=3, decode=3)
    assert (target.prefill, target.decode) == (2, 3)  # releases go one at a time


def test_with_scaling_a_prefill_pool_that_grows_starts_workers_rather_than_wait_for_a_decode_one():
    """A decode worker is free only when its longest answer ends: a prefill pool that must grow
    while the decode pool shrinks starts its workers on the first window, and the decode surplus
    leaves by the release rule."""
    p = planner(total=None, max_prefill=4, max_decode=4, release_after=3)
    prompts = load(10, 2000, 20)  # prefill 2.5 -> 3; decode 200 / 750 / 0.8 = 0.33 -> 1
    target = p.decide(prompts, prefill=1, decode=2)
    assert (target.prefill, target.decode) == (3, 2)
    # the release delay: three windows (the first one's included) that all needed 3:1
    assert p.decide(prompts, prefill=3, decode=2) is None
    target = p.decide(prompts, prefill=3, decode=2)
    assert (target.prefill, target.decode) == (3, 1)


def test_with_scaling_a_worker_is_released_only_after_the_load_stayed_low():
    p = planner(total=None, max_prefill=4, release_after=3)
    busy, quiet = load(10, 2000, 20), load(3, 2000, 20)  # prefill 2.5 -> 3; 0.75 -> 1
    for window in (quiet, busy, quiet, quiet):  # a dip of one window between busy ones
        assert p.decide(window, prefill=3, decode=1) is None
    # three quiet windows running: one worker released, toward the most they needed (1)
    target = p.decide(quiet, prefill=3, decode=1)
    assert (target.prefill, target.decode) == (2, 1)
    assert p.decide(quiet, prefill=2, decode=1).prefill == 1  # then one a window
    # a pool that grows waits neither for the release delay nor for a second window
    assert p.decide(busy, prefill=1, decode=1).prefill == 3


def test_nothing_is_decided_before_the_speeds_and_lengths_are_known():
    p = PoolPlanner(slo_itl_s=0.040, decode_slots=64, total=4)
    assert p.decide(load(10, 2000, 100), prefill=2, decode=2) is None
    assert p.needs(LoadWindow(seconds=10)) is None


def test_a_pool_missing_its_slo_grows_without_waiting_a_second_window():
    p = planner(total=4, slo_ttft_s=2.0)
    window = load(10, 2000, 20)
    window.ttft_s = [0.5] * 8 + [3.0, 4.0]  # p90 over the SLO: prompts are queueing
    target = p.decide(window, prefill=1, decode=3)
    assert (target.prefill, target.decode) == (2, 2)
    calm = load(10, 2000, 20)
    calm.ttft_s = [0.5] * 10
    assert p.decide(calm, prefill=2, decode=2) is None  # within its SLO: patience again
    # decode likewise, by the ITL SLO (40 ms here)
    chatty = load(2, 50, 800)
    chatty.itl_s = [0.06] * 10
    target = p.decide(chatty, prefill=2, decode=2)
    assert (target.prefill, target.decode) == (1, 3)


def test_a_pool_that_misses_its_slo_needs_more_than_the_model_says():
    p = planner(total=None, max_decode=8)
    window = load(2, 50, 300)  # the model: 600 tok/s of decode, under one worker at 80%
    baseline = p.needs(window)[1]
    window.itl_s = [0.030] * 7 + [0.120] * 3  # yet the p90 ITL is 3x the SLO
    p.correct(window)
    assert p.decode_correction == pytest.approx(2.0)  # halfway from 1 to 3
    assert p.needs(window)[1] == pytest.approx(2 * baseline)
    calm = load(2, 50, 300)
    calm.itl_s = [0.030] * 10
    p.correct(calm)
    assert p.decode_correction == pytest.approx(1.0)  # back within the SLO


def _simulated_p90_ttft(servers, rate, service, seconds=50_000.0, seed=1):
    """p90 of wait + service of Poisson arrivals served first come first served by `servers`,
    each prompt taking uniformly 2/3 to 4/3 of `service`."""
    rng = random.Random(seed)
    free = [0.0] * servers
    t, ttft = 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        took = rng.uniform(service * 2 / 3, service * 4 / 3)
        start = max(heapq.heappop(free), t)
        heapq.heappush(free, start + took)
        ttft.append(start + took - t)
    return sorted(ttft)[int(0.9 * len(ttft))]


def test_the_load_a_prefill_pool_holds_within_its_ttft_slo_matches_a_queue_simulation():
    spread = (1 / 3) ** 2 / 3  # uniform over 2/3 to 4/3 of the mean: cs^2 = 1/27
    held = [held_load(c, 0.75, spread, 2.0) for c in (1, 2, 3, 4)]
    # one worker holds half its speed within a TTFT SLO of 2.7 prompts; four, 85% of theirs
    assert held[0] == pytest.approx(0.50, abs=0.01) and held[3] / 4 == pytest.approx(0.85, abs=0.01)
    for servers, load in zip((1, 2, 3, 4), held, strict=True):
        p90 = _simulated_p90_ttft(servers, load / 0.75, 0.75)
        assert p90 == pytest.approx(2.0, rel=0.04)  # the SLO, where the formula puts it
        assert _simulated_p90_ttft(servers, 1.2 * load / 0.75, 0.75) > 2.0  # and past it


def test_with_a_ttft_slo_a_prefill_worker_is_not_filled_past_what_keeps_prompts_from_queueing():
    # 2 req/s of 3,000-token prompts at 10,000 tok/s: 0.3 s each, 0.6 of one worker's time
    window = load(2, 3000, 20)
    without = planner(total=None).needs(window)[0]
    assert without == pytest.approx(0.6 / 0.8)  # 80% utilization: one worker
    slow = planner(total=None, slo_ttft_s=0.6)  # an SLO of two prompts: one worker holds 0.29
    assert 1 < slow.needs(window)[0] < 2
    # an SLO no single prompt can meet is left to utilization: more workers would not help
    assert planner(total=None, slo_ttft_s=0.2).needs(window)[0] == pytest.approx(without)


def test_a_release_waits_for_the_upper_end_of_the_arrival_rate():
    p = planner(total=None, max_prefill=4, release_after=3)
    # 9.2 req/s of 2,000-token prompts: 2.3 workers at 80%, so 3; each window alone says 3
    near = load(9.2, 2000, 20)
    for _ in range(4):
        assert p.decide(near, prefill=3, decode=1) is None
    # 7.6 req/s: 1.9 workers, 2 by every window; but 228 arrivals in 30 s allow 8.2 req/s, 2.05
    # workers: the third is kept
    lower = load(7.6, 2000, 20)
    for _ in range(4):
        assert p.decide(lower, prefill=3, decode=1) is None
    # a window at 6 req/s: 212 arrivals in the last 30 s allow 7.7 req/s, 1.92 workers: released
    target = p.decide(load(6, 2000, 20), prefill=3, decode=1)
    assert (target.prefill, target.decode) == (2, 1)
    assert "req/s included" in target.reason


def test_a_pool_with_workers_on_their_way_in_keeps_its_correction():
    p = planner(total=None, max_decode=8, slo_ttft_s=2.0)
    window = load(2, 50, 300)
    window.itl_s = [0.120] * 10
    window.ttft_s = [8.0] * 10
    p.correct(window, joining=(1, 0))  # a prefill worker is starting: its pool misses for that
    assert p.prefill_correction == 1.0 and p.decode_correction > 1.0


def test_with_a_fixed_total_of_devices_two_tp1_prefill_workers_trade_for_one_tp2_decode_worker():
    """Prefill workers of one rank, decode workers of two, 8 devices: a role change moves two
    prefill workers for one decode worker, and back; the devices always add up to 8."""
    p = planner(total=8, prefill_ranks=1, decode_ranks=2)
    assert p.trade_unit == (2, 1)
    chatty = load(2, 50, 700)  # decode 2.33 workers (4.7 devices), prefill almost nothing
    assert p.decide(chatty, prefill=4, decode=2) is None  # patience
    target = p.decide(chatty, prefill=4, decode=2)
    assert (target.prefill, target.decode) == (2, 3)
    # prompt-heavy: prefill 2.5 workers, decode 0.33 (0.7 devices): 6 devices and 2, one group
    # of them a decision
    heavy = load(10, 2000, 20)
    sizes = [(2, 3)]
    for _ in range(4):
        target = p.decide(heavy, *sizes[-1]) or target
        if (target.prefill, target.decode) != sizes[-1]:
            sizes.append((target.prefill, target.decode))
    assert sizes == [(2, 3), (4, 2), (6, 1)]
    assert all(prefill + 2 * decode == 8 for prefill, decode in sizes)


def test_a_fixed_total_of_devices_is_split_in_whole_workers_of_each_pool():
    """Prefill workers of two ranks, decode workers of three, 18 devices: the splits that keep a
    worker in each pool are 3:4 and 6:2, and a role change trades three prefill workers for two
    decode workers."""
    p = planner(total=18, prefill_ranks=2, decode_ranks=3, patience=1)
    assert p.trade_unit == (3, 2)
    target = p.decide(load(10, 2000, 20), prefill=3, decode=4)  # prefill 5 devices of 6 needed
    assert (target.prefill, target.decode) == (6, 2)
    assert p.decide(load(10, 2000, 20), prefill=6, decode=2) is None
    target = p.decide(load(2, 50, 700), prefill=6, decode=2)  # decode almost all
    assert (target.prefill, target.decode) == (3, 4)


def test_with_scaling_and_two_tp_sizes_a_role_change_moves_a_whole_group_or_starts_workers():
    """Prefill workers of one rank, decode workers of two: a decode pool that grows by one takes
    two spare prefill workers; with only one spare, it starts its worker instead, and the spare
    leaves by the release rule."""
    p = planner(total=None, max_prefill=4, max_decode=4, prefill_ranks=1, decode_ranks=2)
    chatty = load(2, 50, 700)  # prefill 1; decode 2.3 -> 3
    assert p.decide(chatty, prefill=3, decode=2) is None  # a role change waits
    target = p.decide(chatty, prefill=3, decode=2)
    assert (target.prefill, target.decode) == (1, 3)  # two prefill workers for one decode
    target = p.decide(chatty, prefill=2, decode=2)
    assert (target.prefill, target.decode) == (2, 3)  # one spare: a start, at once

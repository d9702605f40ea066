"""When a prompt-finishing prefill call should come back: what a decode worker waits for before
planning."""

import math

import pytest

from scheduler.cell.call_clock import HANDOFF_EARLY, CallClock


def test_seconds_per_token_is_a_moving_average_of_calls_that_computed_tokens():
    clock = CallClock(smoothing=0.5)
    assert clock.length("p", 100) == math.inf  # nothing measured yet: no end can be expected
    clock.observe("p", 1.0, 100)
    clock.observe("p", 3.0, 100)
    clock.observe("p", 0.5, 0)  # a call that only imported KV says nothing of the pace
    assert clock.s_per_token["p"] == pytest.approx(0.02) and clock.ends(
        "p", 50, 10.0
    ) == pytest.approx(11.0)


def test_a_worker_that_changed_roles_is_measured_afresh():
    clock = CallClock()
    clock.observe("prefill-1", 0.1, 1000)  # 0.1 ms a prompt token
    clock.finishing_sent("prefill-1", 0.0, 1000, queued=False)
    clock.forget("prefill-1")  # now a decode worker: its prompt pace says nothing of its steps
    assert clock.length("prefill-1", 10) == math.inf and not clock.handoff_due(100.0)


def test_a_call_queued_behind_another_leaves_the_running_one_expected():
    clock = CallClock()
    clock.observe("p", 1.0, 100)  # 10 ms a token
    clock.finishing_sent("p", 0.0, 100, queued=False)  # ends at 1.0
    clock.finishing_sent("p", 0.1, 50, queued=True)  # ends when? only once the first returns
    assert clock.handoff_due(0.95) and not clock.handoff_due(0.5)
    clock.returned("p", 0.0)
    assert not clock.handoff_due(100.0)  # the queued call has not started
    clock.started("p", 0.1, 50, now=1.2)  # ends at 1.7
    assert clock.handoff_due(1.7) and not clock.handoff_due(1.5)
    clock.lost("p")
    assert not clock.handoff_due(math.inf)


def test_a_call_counts_as_due_a_fraction_of_its_length_before_its_expected_end():
    clock = CallClock()
    clock.observe("p", 0.4, 100)
    clock.finishing_sent("p", 0.0, 100, queued=False)  # expected at 0.4
    early = 0.4 - HANDOFF_EARLY * 0.4
    assert clock.handoff_due(early + 1e-9) and not clock.handoff_due(early - 1e-3)
    clock.started("q", 0.0, 10, now=1.0)  # not a prompt-finishing call: nothing to expect
    assert list(clock.finishing) == ["p"]

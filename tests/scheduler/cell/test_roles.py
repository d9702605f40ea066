"""Workers change pools under load without losing or changing a request; the planner's window
moves the worker the load asks for."""

import pytest

from scheduler.cell.state import WorkerStatus
from scheduler.load_window import LoadWindow
from scheduler.pool_planner import Speeds
from tests.scheduler.cell.cells import (
    LEDGER,
    Streams,
    assert_idle,
    cell,
    expected_tokens,
    fake_step,
    req,
    step_all,
)


def run_steps(coordinator, streams, steps, seen=None):
    """Step every live worker `steps` times; `seen(worker, plan)` for each step."""
    for _ in range(steps):
        for worker in list(coordinator.workers):
            if worker.status is not WorkerStatus.UP:
                continue
            step = coordinator.next_step(worker)
            if step is None:
                continue
            if seen is not None:
                seen(worker, step[0])
            coordinator.apply(worker, step[0], fake_step(coordinator, worker, *step))
            streams.take(coordinator)


def planned_cell(patience=2, **kw):
    """A cell with the pool planner on, its workers measured at: 10,000 prompt tokens per busy
    second of a prefill worker, decode steps of 10 ms + 1 ms per sequence."""
    coordinator = cell(pool_planner=True, **kw)
    planner = coordinator.pools.planner
    planner.speeds = Speeds(prefill_tok_s=10_000, decode_fixed_s=0.010, decode_per_seq_s=0.001)
    planner.patience = patience
    return coordinator


def close_window(coordinator, prompt_tokens, output_tokens, at=10):
    """A 10 s window of 100 arrivals and 100 finished requests with these token counts, closed at
    `at` s from the start; the planner's decisions (one per worker)."""
    coordinator.pools.window = LoadWindow(
        seconds=10,
        arrivals=100,
        prompt_tokens=prompt_tokens,
        finished=100,
        output_tokens=output_tokens,
    )
    return coordinator.end_window(now_s=coordinator.pools.started_s + at)


def test_a_prefill_worker_becomes_a_decode_worker_under_load_and_nothing_changes():
    coordinator = cell(num_prefill_workers=2, num_decode_workers=1, decode_slots=4)
    streams = Streams()
    for i in range(6):
        coordinator.admit(req(f"r{i}", prompt_len=10 + i, max_tokens=8), consumer="c")
    run_steps(coordinator, streams, 2)
    leaving = coordinator.prefill[1]
    held = set(leaving.step_planner.requests)
    assert held, "it holds prompts when it starts leaving"
    coordinator.roles.begin(leaving, "decode")
    assert leaving.next_kind == "decode" and not leaving.accepts
    # new prompts go to the worker that stays
    coordinator.admit(req("late", prompt_len=9, max_tokens=8), consumer="c")
    assert "late" in coordinator.prefill[0].step_planner.requests
    LEDGER.pop(leaving, None)  # (the fake's ledger of its blocks starts over when it decodes)
    step_all(coordinator, streams)
    names = [f"r{i}" for i in range(6)] + ["late"]
    assert streams.tokens == {r: expected_tokens(r, 8) for r in names}
    assert set(streams.finish.values()) == {"length"}
    assert leaving.kind == "decode" and leaving.name == "decode-1" and leaving.actor == "prefill-1"
    assert [w.name for w in coordinator.prefill] == ["prefill-0"]
    assert coordinator.roles.take_switched() == [leaving]
    assert coordinator.stats()["pools"]["role_changes"] == 1
    assert_idle(coordinator)


def test_a_decode_worker_finishes_its_requests_then_prefills_and_new_work_uses_it():
    coordinator = cell(num_prefill_workers=1, num_decode_workers=2, decode_slots=4)
    streams = Streams()
    for i in range(4):
        coordinator.admit(req(f"a{i}", prompt_len=6, max_tokens=12), consumer="c")
    run_steps(coordinator, streams, 12)
    leaving = next(w for w in coordinator.decode if w.step_planner.running)
    running = set(leaving.step_planner.requests)
    coordinator.roles.begin(leaving, "prefill")
    for i in range(4):
        coordinator.admit(req(f"b{i}", prompt_len=7, max_tokens=6), consumer="c")
    decoded_on = {}

    def seen(worker, plan):
        for chunk in plan.decode:
            decoded_on.setdefault(chunk.req_id, set()).add(worker.actor)

    run_steps(coordinator, streams, 200, seen)
    # what it held ran to the end there; nothing new was decoded on it while it was leaving
    assert all(decoded_on[r] == {leaving.actor} for r in running)
    assert all(leaving.actor not in decoded_on[f"b{i}"] for i in range(4))
    assert leaving.kind == "prefill" and leaving.name == "prefill-1"
    expected = {f"a{i}": expected_tokens(f"a{i}", 12) for i in range(4)}
    expected |= {f"b{i}": expected_tokens(f"b{i}", 6) for i in range(4)}
    assert streams.tokens == expected
    # and it prefills new prompts now
    coordinator.admit(req("c0", prompt_len=8, max_tokens=3), consumer="c")
    coordinator.admit(req("c1", prompt_len=8, max_tokens=3), consumer="c")
    assert any(r in leaving.step_planner.requests for r in ("c0", "c1"))
    # its first call in the new pool tells the worker to drop what it kept for the old requests
    plan, imports = coordinator.next_step(leaving)
    assert running <= set(plan.forget)
    coordinator.apply(leaving, plan, fake_step(coordinator, leaving, plan, imports))
    streams.take(coordinator)
    step_all(coordinator, streams)
    assert streams.tokens["c0"] == expected_tokens("c0", 3)
    assert_idle(coordinator)


def test_a_worker_changes_pools_only_when_its_call_in_flight_is_back():
    """The actor shell keeps a call in flight ahead of the one it applies: a call planned for the
    worker's old role must come back before the worker takes its new one."""
    coordinator = cell(num_prefill_workers=1, num_decode_workers=2, decode_slots=4)
    streams = Streams()
    for i in range(2):
        coordinator.admit(req(f"a{i}", prompt_len=6, max_tokens=8), consumer="c")
    run_steps(coordinator, streams, 40)
    leaving = coordinator.decode[0]
    assert leaving.step_planner.idle
    leaving.calls_in_flight = 1  # (a call sent before it started leaving, not back yet)
    coordinator.roles.begin(leaving, "prefill")
    assert leaving.kind == "decode" and leaving.next_kind == "prefill"
    leaving.calls_in_flight = 0  # it is back: the next applied step, or worker_back, moves it
    coordinator.roles.finish()
    assert leaving.kind == "prefill" and leaving.next_kind is None


def test_the_planner_moves_a_worker_to_the_pool_the_load_needs():
    coordinator = planned_cell(num_prefill_workers=2, num_decode_workers=2)
    assert coordinator.pools.planner.total == 4
    # output-heavy: 10 requests/s of 100 prompt tokens and 500 output tokens
    assert close_window(coordinator, 100 * 100, 100 * 500) == []  # patience
    [decision] = close_window(coordinator, 100 * 100, 100 * 500)
    assert decision["to"] == "decode"
    assert (decision["prefill"], decision["decode"]) == (1, 3)
    assert "prefill needs" in decision["reason"]
    # an idle worker holds nothing: it moves at once
    assert len(coordinator.prefill) == 1 and len(coordinator.decode) == 3
    assert coordinator.stats()["pools"]["decisions"] == [decision]
    assert coordinator.stats()["pools"]["changes"] == {"role_change": {"decode": 1}}
    assert coordinator.metrics.role_changes.values  # counted


def test_a_pool_keeps_one_worker_that_takes_new_work():
    coordinator = planned_cell(patience=1, num_prefill_workers=1, num_decode_workers=1)
    assert close_window(coordinator, 10_000, 50_000) == []
    assert [w.kind for w in coordinator.workers] == ["prefill", "decode"]


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_starting_to_leave_twice_or_for_its_own_pool_changes_nothing(kind):
    coordinator = cell(num_prefill_workers=2, num_decode_workers=2)
    worker = (coordinator.prefill if kind == "prefill" else coordinator.decode)[0]
    coordinator.roles.begin(worker, kind)
    assert worker.next_kind is None and worker.kind == kind


def test_with_room_to_grow_the_planner_starts_a_worker_and_releases_an_idle_one():
    coordinator = planned_cell(
        patience=1,
        num_prefill_workers=1,
        num_decode_workers=1,
        max_prefill_workers=3,
        max_decode_workers=3,
    )
    planner = coordinator.pools.planner
    assert planner.total is None and planner.max_prefill == 3

    # 10 req/s of 2,000-token prompts: 20,000 tok/s of prefill needs 2.5 workers; 200 tok/s of
    # 20-token answers need 1.5 decode workers of 2 slots (2 / 12 ms at 80%): all three new
    # workers start at once
    decisions = close_window(coordinator, 200_000, 2_000, 10)
    assert [(d["worker"], d["to"]) for d in decisions] == [
        ("prefill-1", "prefill"),
        ("prefill-2", "prefill"),
        ("decode-1", "decode"),
    ]
    assert coordinator.stats()["pools"]["decisions"] == decisions
    added = coordinator.prefill[1:] + coordinator.decode[1:]
    assert all(w.status is WorkerStatus.RESTARTING and not w.accepts for w in added)  # not yet
    # the load falls away: an idle prefill worker is released once the windows of the release
    # delay (30 s: three) all needed fewer, and one a window
    for worker in added:
        worker.status = WorkerStatus.UP
    assert coordinator.pools.planner.release_after == 3
    assert close_window(coordinator, 1_000, 2_000, 20) == []
    assert close_window(coordinator, 1_000, 2_000, 30) == []
    [decision] = close_window(coordinator, 1_000, 2_000, 40)
    assert decision["to"] == "release"
    released = coordinator.roles.take_released()
    assert len(released) == 1 and released[0].status is WorkerStatus.GONE
    assert len(coordinator.prefill) == 2 and coordinator.roles.removed == 1
    # every decision counted by kind and pool, for /metrics (the decisions list keeps the last 50)
    assert coordinator.stats()["pools"]["changes"] == {
        "start": {"prefill": 2, "decode": 1},
        "release": {"prefill": 1},
    }


def test_with_a_fixed_total_a_pool_may_grow_past_the_size_it_started_with():
    coordinator = planned_cell(patience=1, num_prefill_workers=2, num_decode_workers=2)
    # prompt-heavy: 20,000 tok/s of prompts needs 2.5 prefill workers, decode almost nothing
    [decision] = close_window(coordinator, 200_000, 100)
    assert (decision["prefill"], decision["decode"]) == (3, 1)


def test_with_a_period_the_planner_starts_workers_a_start_up_before_the_load_comes_back():
    coordinator = planned_cell(
        num_prefill_workers=1,
        num_decode_workers=1,
        max_prefill_workers=3,
        planner_period_s=70,
    )
    pools = coordinator.pools
    pools.on_started(25.0)  # a started worker answered 25 s after its start
    assert pools.planner.forecast.period_s == 70 and pools.planner.startup_s == 25.0
    # 10 s windows: three quiet, three of 10 req/s of 2,000-token prompts (2.1 workers), one
    # quiet, twice. The first time, the busy windows start the workers when they come
    quiet, busy = (1_000, 2_000), (200_000, 2_000)
    day = [quiet] * 3 + [busy] * 3 + [quiet]
    sizes, reasons = [], []
    for tokens in day + day[:3]:
        decisions = close_window(coordinator, *tokens)
        for worker in coordinator.workers:
            worker.status = WorkerStatus.UP  # (started workers answer at once here)
        sizes.append(len(coordinator.prefill))
        reasons.append([d["reason"] for d in decisions])
    assert sizes[:4] == [1, 1, 1, 3]
    # the second time, at 70 s the next 35 s (a start-up and a window) a period ago needed two:
    # the third worker is released, for it is needed only from 110 s on (the middle busy window,
    # whose neighbours are busy too); at 80 s that window is within 35 s: it starts again
    assert sizes[6:9] == [2, 3, 3]
    assert reasons[7] and all(
        "a period ago the next 35 s needed at most 3:1" in r for r in reasons[7]
    )
    assert coordinator.stats()["pools"]["last_window"]["forecast"] == (3, 1)


def test_pools_of_two_tp_sizes_trade_whole_workers_that_hold_the_same_devices():
    """Prefill workers of one rank, decode workers of two: output-heavy load releases two prefill
    workers and starts one decode worker on their devices; prompt-heavy load, the reverse."""
    coordinator = planned_cell(
        patience=1,
        num_prefill_workers=3,
        num_decode_workers=1,
        prefill_tensor_parallel_size=1,
        decode_tensor_parallel_size=2,
    )
    assert coordinator.pools.planner.total == 5  # devices
    decisions = close_window(coordinator, 100 * 100, 100 * 500)
    assert sorted(d["to"] for d in decisions) == ["decode", "release", "release"]
    assert {(d["prefill"], d["decode"]) for d in decisions} == {(1, 2)}
    # idle, the two leave at once (their actors are stopped); the new one starts
    released = coordinator.roles.take_released()
    assert sorted(w.kind for w in released) == ["prefill", "prefill"]
    assert len(coordinator.prefill) == 1 and coordinator.prefill[0] not in released
    started = coordinator.decode[1]
    assert started.status is WorkerStatus.RESTARTING and started.actor == "decode-1"
    assert coordinator.stats()["pools"]["changes"] == {"role_change": {"decode": 1}}
    started.status = WorkerStatus.UP
    decisions = close_window(coordinator, 200_000, 100, at=20)
    assert sorted(d["to"] for d in decisions) == ["prefill", "prefill", "release"]
    [leaving] = coordinator.roles.take_released()
    assert leaving.kind == "decode" and len(coordinator.decode) == 1
    assert len(coordinator.prefill) == 3
    assert coordinator.stats()["pools"]["changes"] == {"role_change": {"decode": 1, "prefill": 2}}

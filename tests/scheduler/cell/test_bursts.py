"""Decode bursts without Ray or a model: several decode steps in one worker call change no
output."""

import pytest

from scheduler.cell.bursts import BurstSizer, may_burst, plan_call
from scheduler.request import Request
from tests.scheduler.cell.cells import (
    Streams,
    assert_idle,
    cell,
    expected_tokens,
    fake_step,
    req,
    step_all,
    token,
)

# per burst run_calls saw: whether the prefill pool held prompts
bursts_while_prompts_wait: list[bool] = []


def run_calls(coordinator, streams, max_steps, calls=None, before_call=None):
    """The actor's loop by hand: each worker keeps one call in flight ahead, a call is `plan_call`'s
    plans (each answered by the fake worker in order), applied step by step. Returns every call's
    plans."""
    calls = [] if calls is None else calls
    in_flight: dict = {}
    for n in range(1000):
        if before_call is not None:
            before_call(n)
        for worker in coordinator.workers:
            call = plan_call(coordinator, worker, max_steps)
            sent = None
            if call is not None:
                plans, imports = call
                calls.append((worker.kind, plans, imports))
                if len(plans) > 1:  # only while nothing else could use the worker sooner
                    sched = worker.step_planner
                    full = not sched.free_slots and not sched.can_preempt_for_waiting()
                    assert (
                        full
                        or not sched.num_waiting
                        and all(p.step_planner.idle for p in coordinator.prefill)
                    )
                    bursts_while_prompts_wait.append(
                        not all(p.step_planner.idle for p in coordinator.prefill)
                    )
                sent = [
                    (plan, fake_step(coordinator, worker, plan, imports if i == 0 else []))
                    for i, plan in enumerate(plans)
                ]
            for plan, result in in_flight.pop(worker.name, []):
                coordinator.apply(worker, plan, result)
                streams.take(coordinator)
            if sent is not None:
                in_flight[worker.name] = sent
        if not in_flight and all(w.step_planner.idle for w in coordinator.workers):
            return calls
    raise AssertionError("the requests never finished")


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_bursts_change_no_output_and_never_run_past_a_stop(mode):
    """Requests stopping on a stop id, at max_tokens, all in the middle of bursts: each stream gets
    exactly its tokens, and what a burst sampled after a request's stop never reaches it."""
    stop_at = {"s0": 2, "s1": 7, "s2": 12}
    coordinator, streams = cell(mode=mode, decode_slots=8, token_budget=32), Streams()
    requests = [req(f"r{i}", prompt_len=3 + 2 * i, max_tokens=1 + 5 * i) for i in range(5)]
    for name, index in stop_at.items():
        requests.append(
            Request(
                req_id=name,
                prompt_ids=[1, 2, 3],
                max_tokens=30,
                stop_token_ids=frozenset({token(name, index)}),
            )
        )
    for request in requests:
        coordinator.admit(request, consumer="c")
    calls = run_calls(coordinator, streams, max_steps=6)
    for request in requests:
        length = stop_at[request.req_id] + 1 if request.req_id in stop_at else request.max_tokens
        assert streams.tokens[request.req_id] == expected_tokens(request.req_id, length), (
            request.req_id
        )
        assert streams.finish[request.req_id] == ("stop" if request.req_id in stop_at else "length")
    assert_idle(coordinator)
    bursts = [plans for kind, plans, _ in calls if len(plans) > 1]
    assert bursts and max(map(len, bursts)) == 6
    assert all(
        kind == "decode" and not imports and not any(p.prefill for p in plans)
        for kind, plans, imports in calls
        if len(plans) > 1
    )


def test_no_burst_while_a_waiting_or_prefilling_prompt_could_take_a_free_slot():
    """Prompts keep arriving: while the decode worker has a free slot, a burst never forms while one
    waits or is prefilled (it would keep it, or its handoff, out of the worker's next steps); it
    forms once they are all decoding, or once the worker is full."""
    coordinator, streams = cell(decode_slots=4, prefill_slots=1), Streams()

    def arrive(n):
        if n % 5 == 0 and n < 40:
            coordinator.admit(req(f"r{n}", prompt_len=8, max_tokens=30), consumer="c")

    calls = run_calls(coordinator, streams, max_steps=4, before_call=arrive)
    assert streams.tokens == {f"r{n}": expected_tokens(f"r{n}", 30) for n in range(0, 40, 5)}
    assert any(len(plans) > 1 for _, plans, _ in calls)
    assert all(len(plans) == 1 for kind, plans, _ in calls if kind == "prefill")
    assert_idle(coordinator)


def test_bursts_with_requests_waiting_for_a_slot_end_where_a_slot_frees():
    """One slot, three requests: the ones waiting cannot start before the running one ends, so calls
    burst, but a burst ends with the step that plans the running request's last token: the next one
    starts at once."""
    coordinator, streams = cell(mode="colocated", decode_slots=1), Streams()
    requests = [req(f"r{i}", max_tokens=20) for i in range(3)]
    for request in requests:
        coordinator.admit(request, consumer="c")
    calls = run_calls(coordinator, streams, max_steps=8)
    assert streams.tokens == {r.req_id: expected_tokens(r.req_id, 20) for r in requests}
    bursts = [plans for _, plans, _ in calls if len(plans) > 1]
    assert bursts
    for plans in bursts:
        last_tokens = [
            i for i, plan in enumerate(plans) for c in plan.decode if c.output_index == 19
        ]
        assert last_tokens in ([], [len(plans) - 1])
    # a waiting request that may preempt: no burst
    coordinator = cell(mode="colocated", decode_slots=1)
    coordinator.admit(req("slow", max_tokens=20, priority=1), consumer="c")
    worker = coordinator.decode[0]
    while not worker.step_planner.running or not all(
        r.is_decoding for r in worker.step_planner.running
    ):
        # the prompt's chunks (results never applied: none needed here)
        plan_call(coordinator, worker, 1)
    coordinator.admit(req("same", max_tokens=3, priority=1), consumer="c")
    assert may_burst(worker, [])
    coordinator.admit(req("urgent", max_tokens=3, priority=0), consumer="c")
    assert not may_burst(worker, [])


def test_an_abort_during_a_burst_ends_the_stream_once():
    coordinator, streams = cell(mode="colocated", decode_slots=4), Streams()
    for i in range(3):
        coordinator.admit(req(f"r{i}", max_tokens=40), consumer="c")

    def abort_midway(n):
        if n == 6:
            assert coordinator.abort("r1")

    run_calls(coordinator, streams, max_steps=8, before_call=abort_midway)
    assert streams.finish == {"r0": "length", "r1": "abort", "r2": "length"}
    assert streams.tokens["r1"] == expected_tokens("r1", len(streams.tokens["r1"]))
    assert len(streams.tokens["r1"]) < 40
    assert_idle(coordinator)


def test_burst_length_keeps_the_call_overhead_a_small_share():
    sizer = BurstSizer(max_burst_s=0.020, max_steps=16, overhead_share=0.1)
    assert sizer.length("decode-0") == 1  # nothing measured yet
    # 1 ms beyond a 0.5 ms step
    sizer.observe("decode-0", steps=1, period_s=0.0015, worker_s=0.0005)
    assert sizer.length("decode-0") == 16  # 20 wanted, capped by max_steps
    # 1 ms beyond 5 ms: 2 steps make it 10%
    sizer.observe("gpu", steps=1, period_s=0.006, worker_s=0.005)
    assert sizer.length("gpu") == 2
    sizer.observe("big", steps=1, period_s=0.101, worker_s=0.100)  # 1% already: one step a call
    assert sizer.length("big") == 1
    # the time cap: 20 ms of steps
    sizer.observe("slow-call", steps=1, period_s=0.030, worker_s=0.004)
    assert sizer.length("slow-call") == 5
    # per step: 0.5 ms; per call: 1 ms
    sizer.observe("decode-1", steps=4, period_s=0.003, worker_s=0.002)
    assert sizer.length("decode-1") == 16
    sizer.forget("decode-1")  # it changed roles: measured afresh
    assert sizer.length("decode-1") == 1 and sizer.length("decode-0") == 16
    off = BurstSizer(max_burst_s=0.0)
    off.observe("decode-0", steps=1, period_s=0.0015, worker_s=0.0005)
    assert off.length("decode-0") == 1
    with pytest.raises(ValueError):
        BurstSizer(max_burst_s=-1)


def test_a_full_decode_worker_bursts_while_prompts_wait_on_the_prefill_pool():
    """Under overload nothing the prefill pool holds can start before a running request ends, so the
    decode worker keeps bursting (it used to wait for the prefill pool to empty); every stream is
    unchanged."""
    coordinator, streams = cell(decode_slots=2, prefill_slots=1), Streams()
    for i in range(8):
        coordinator.admit(req(f"r{i}", max_tokens=25), consumer="c")
    bursts_while_prompts_wait.clear()
    run_calls(coordinator, streams, max_steps=4)
    assert streams.tokens == {f"r{i}": expected_tokens(f"r{i}", 25) for i in range(8)}
    assert any(bursts_while_prompts_wait)
    assert_idle(coordinator)
    worker = coordinator.decode[0]  # a free slot and a prompt on the prefill pool: no burst
    coordinator.admit(req("a", max_tokens=25), consumer="c")
    while not worker.step_planner.running or not all(
        r.is_decoding for r in worker.step_planner.running
    ):
        step_all(coordinator, streams, steps=1)
    coordinator.admit(req("b", max_tokens=25), consumer="c")
    assert worker.step_planner.free_slots and not may_burst(worker, coordinator.prefill)

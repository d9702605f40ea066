"""Preemption in the policy: who is evicted, the starvation guard, and consistent slots after each
step."""

import functools

from scheduler.step_planner import StepPlanner
from tests.factories import make_request
from tests.scheduler.test_step_planner import check_invariants

req = functools.partial(make_request, prompt_len=4, max_tokens=10, arrival_s=0.0)


def step(sched):
    plan = sched.plan()
    check_invariants(sched, plan)
    sched.update(plan, {c.req_id: 7 for c in plan.chunks if c.sample})
    return plan


def test_urgent_request_evicts_the_least_urgent_with_most_work_left():
    sched = StepPlanner(num_slots=3, capacity=64, token_budget=64, prefill_chunk=64)
    sched.submit(req("a", max_tokens=30, priority=1, arrival_s=1))
    sched.submit(req("b", max_tokens=10, priority=1, arrival_s=2))
    sched.submit(req("c", max_tokens=50, priority=0, arrival_s=3))  # most work, but more urgent
    step(sched)
    step(sched)
    sched.submit(req("urgent", priority=-1, arrival_s=4))
    plan = step(sched)
    assert plan.preempted == ["a"]  # priority 1 beats 0; of those, a has more left than b
    assert {c.req_id for c in plan.chunks} == {"b", "c", "urgent"}
    evicted = sched.requests["a"]
    assert evicted.num_computed == 0 and evicted.num_preemptions == 1 and evicted.slot is None
    assert evicted.output_ids == [7, 7]  # what it streamed stays; it is recomputed, not restarted
    assert sched.num_recomputed_tokens == 5  # prompt 4 + 1 computed output token
    assert [r.req_id for r in sched.waiting_requests()] == ["a"]


def test_equal_priority_never_preempts():
    sched = StepPlanner(num_slots=1, capacity=64)
    sched.submit(req("a"))
    step(sched)
    sched.submit(req("b"))
    assert step(sched).preempted == []


def test_starvation_guard_stops_evicting_after_max_preemptions():
    sched = StepPlanner(
        num_slots=1, capacity=256, token_budget=64, prefill_chunk=64, max_preemptions=2
    )
    sched.submit(req("slow", max_tokens=100, priority=5))
    step(sched)
    evictions = []
    for i in range(3):  # a stream of urgent requests, each arriving once slow is running again
        sched.submit(req(f"u{i}", max_tokens=2, priority=0, arrival_s=1 + i))
        plan = step(sched)
        evictions.append(plan.preempted)
        for _ in range(4):
            step(sched)
        assert sched.requests["slow"].status.value == "running"
    assert evictions == [["slow"], ["slow"], []]
    assert sched.requests["slow"].num_preemptions == 2
    assert [r.req_id for r in sched.waiting_requests()] == ["u2"]  # it waits its turn instead


def test_preempted_request_recomputes_prompt_and_output_then_continues():
    sched = StepPlanner(num_slots=1, capacity=64, token_budget=8, prefill_chunk=8)
    sched.submit(req("a", prompt_len=6, max_tokens=5, priority=1))
    step(sched)
    step(sched)  # a has outputs [7, 7], 7 tokens computed
    sched.submit(req("u", prompt_len=3, max_tokens=1, priority=0, arrival_s=1))
    # u runs to completion in a's slot; the worker drops a's state
    assert step(sched).released == ["a"]
    plan = step(sched)  # a is back: recomputes prompt + both outputs, sampling its third token
    chunk = plan.chunks[0]
    assert chunk.sampling is not None  # sent again with the recompute's first chunk
    assert (
        chunk.req_id == "a" and chunk.start_pos == 0 and chunk.token_ids == [1, 2, 3, 4, 5, 6, 7, 7]
    )
    assert chunk.sample and chunk.output_index == 2

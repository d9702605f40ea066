"""Preemption in the policy: who is evicted, the starvation guard, and consistent slots after each
step."""

import functools
import random

import pytest

from scheduler.step_planner import StepPlanner
from tests.factories import make_request, prompt_ids
from tests.scheduler.invariants import check_invariants

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
    assert step(sched).forget == ["a"]
    plan = step(sched)  # a is back: recomputes prompt + both outputs, sampling its third token
    chunk = plan.chunks[0]
    assert chunk.sampling is not None  # sent again with the recompute's first chunk
    assert (
        chunk.req_id == "a" and chunk.start_pos == 0 and chunk.token_ids == [1, 2, 3, 4, 5, 6, 7, 7]
    )
    assert chunk.sample and chunk.output_index == 2


def overlapped(sched, limit=1000):
    """Step as the Ray loop does: plan N+1, then apply N's tokens; the number of plans (an
    AssertionError if the requests never end)."""
    in_flight, plans = None, 0
    while in_flight is not None or not sched.idle:
        plans += 1
        assert plans < limit, "the requests never end"
        plan = sched.plan()
        check_invariants(sched, plan)
        sent = None if plan.empty else (plan, {c.req_id: 7 for c in plan.chunks if c.sample})
        if in_flight is not None:
            sched.update(*in_flight)
        in_flight = sent
    return plans


def test_a_request_whose_last_token_is_in_flight_is_not_evicted_for_a_stuck_prompt():
    """Two requests the pool cannot hold together, steps overlapping: when a's last token is in
    flight and b's prompt cannot grow, b waits for that step (it frees a's blocks) instead of
    evicting a and throwing its work away; evicted, a came back, found its prefix cached, ran to
    its last token again and evicted b in turn, forever."""
    sched = StepPlanner(
        num_slots=3,
        capacity=96,
        num_blocks=9,
        block_size=16,
        prefix_caching=True,
        token_budget=24,
        prefill_chunk=5,
    )
    sched.submit(make_request("a", prompt_len=67, max_tokens=15, seed=1, arrival_s=0.0))
    sched.submit(make_request("b", prompt_len=54, max_tokens=15, seed=2, arrival_s=1.0))
    a, b = sched.requests["a"], sched.requests["b"]
    overlapped(sched)
    assert a.output_ids == b.output_ids == [7] * 15
    assert a.num_preemptions + b.num_preemptions <= 2


def test_a_request_evicted_for_an_urgent_one_is_not_readmitted_by_the_same_plan():
    """With its prefix cached and its first chunk small, the evicted request would fit again at
    once (a seat is free and a third request waits, so the plan admits more than one); readmitted
    in the same plan, its seat's chunk still in flight came back as a result for the new seat
    (and the next for a token it already had)."""
    sched = StepPlanner(
        num_slots=3,
        capacity=28,
        num_blocks=7,
        block_size=4,
        prefix_caching=True,
        token_budget=64,
        prefill_chunk=8,
    )
    sched.submit(make_request("r", prompt_len=20, max_tokens=8, priority=1, seed=3))
    in_flight = None
    while len(sched.requests["r"].output_ids) < 3:
        plan = sched.plan()
        sent = (plan, {c.req_id: 7 for c in plan.chunks if c.sample})
        if in_flight is not None:
            sched.update(*in_flight)
        in_flight = sent
    sched.submit(make_request("u", prompt_len=8, max_tokens=2, priority=0, seed=4))
    sched.submit(make_request("x", prompt_len=12, max_tokens=2, priority=2, seed=5))
    plan = sched.plan()
    assert plan.preempted == ["r"]
    assert "r" not in {c.req_id for c in plan.chunks}
    assert sched.requests["r"].status.value == "waiting"
    sched.update(*in_flight)
    sched.update(plan, {c.req_id: 7 for c in plan.chunks if c.sample})
    overlapped(sched)
    assert sched.requests == {} or all(r.finished for r in sched.requests.values())


@pytest.mark.parametrize("seed", range(0, 300, 50))
def test_random_workloads_under_block_pressure_end_when_steps_overlap(seed):
    """Shared prefixes, priorities and pools of one to two requests' worth of blocks, stepped as
    the Ray loop steps: every request ends with all its tokens (50 workloads a case)."""
    for trial in range(seed, seed + 50):
        rng = random.Random(trial)
        block_size = rng.choice([1, 4, 8, 16])
        system = prompt_ids(rng.randint(1, 70), trial)
        requests = [
            make_request(
                f"r{i}",
                max_tokens=rng.randint(1, 40),
                priority=rng.choice([0, 0, 1]),
                arrival_s=float(i),
            )
            for i in range(rng.randint(2, 8))
        ]
        for request in requests:
            shared = system if rng.random() < 0.6 else []
            request.prompt_ids = shared + prompt_ids(rng.randint(1, 60), rng.randrange(10**6))
        longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
        capacity = -(-longest // block_size) * block_size
        one = capacity // block_size + 1
        budget = rng.choice([8, 24, 64])
        sched = StepPlanner(
            num_slots=rng.randint(1, 5),
            capacity=capacity,
            num_blocks=one + rng.randint(0, one),
            block_size=block_size,
            prefix_caching=rng.random() < 0.8,
            token_budget=budget,
            prefill_chunk=rng.choice([c for c in (1, 5, 8, 16) if c <= budget]),
        )
        for request in requests:
            sched.submit(request)
        overlapped(sched, limit=5000)
        assert all(len(r.output_ids) == r.max_tokens for r in requests), trial


def test_a_request_that_cannot_grow_takes_the_blocks_reserved_for_a_prompt_still_prefilling():
    """A decode worker reserves blocks for a prompt prefilling elsewhere (its KV is imported as
    it comes). When a running request needs them, the reservation goes back (the prompt imports
    its KV whole at its handoff) rather than the request evicting itself, coming back and doing
    so again, forever, while the prompt may be waiting for this very worker's queue to drain."""
    sched = StepPlanner(
        num_slots=2, capacity=28, num_blocks=8, block_size=4, token_budget=8, prefill_chunk=8
    )
    sched.submit(req("r", prompt_len=8, max_tokens=20))
    while len(sched.requests["r"].output_ids) < 3:
        step(sched)
    assert sched.reserve("p", 16)  # 4 blocks of the 5 r does not hold
    for _ in range(100):
        if sched.idle:
            break
        plan = sched.plan()
        sched.update(plan, {c.req_id: 7 for c in plan.chunks if c.sample})
        assert sched.num_preemptions == 0
    assert sched.requests == {} and sched.take_dropped_reservations() == ["p"]
    assert "p" not in sched.reserved and sched.blocks.num_free == 8

"""The planner on plain lists: budgets, decode first, oldest first, slots, abort, errors."""

import functools

import pytest

from scheduler.plan import StepPlan
from scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from scheduler.step_planner import QueueFullError, StepPlanner
from tests.factories import make_request
from tests.scheduler.invariants import check_invariants

req = functools.partial(make_request, prompt_len=10, max_tokens=4)


def fake_step(sched: StepPlanner, token: int = 7) -> tuple[StepPlan, list[Request]]:
    """Plan and pretend a worker sampled `token` for every sampling chunk."""
    plan = sched.plan()
    check_invariants(sched, plan)
    return plan, sched.update(plan, {c.req_id: token for c in plan.chunks if c.sample}).finished


def test_decode_first_then_prefill_oldest_first_within_budget():
    sched = StepPlanner(num_slots=3, capacity=64, token_budget=8, prefill_chunk=5)
    for name in "abc":
        sched.submit(req(name, prompt_len=10))
    plan, _ = fake_step(sched)
    assert [(c.req_id, c.num_tokens) for c in plan.prefill] == [("a", 5), ("b", 3)]
    plan, _ = fake_step(sched)  # a has 5 left: chunk 5 finishes its prompt and samples token 1
    assert [(c.req_id, c.num_tokens, c.sample) for c in plan.prefill] == [
        ("a", 5, True),
        ("b", 3, False),
    ]
    plan, _ = fake_step(sched)
    assert [c.req_id for c in plan.decode] == ["a"]  # decode before any prefill
    assert [(c.req_id, c.start_pos, c.num_tokens) for c in plan.prefill] == [
        ("b", 6, 4),
        ("c", 0, 3),
    ]
    assert plan.decode[0].token_ids == [7] and plan.decode[0].start_pos == 10


def test_a_short_prompt_waits_for_one_long_prompt_at_most():
    """Two prompts needing several chunks and a short one behind them: the oldest long one, then the
    short one, then the other long one gets what is left of the budget (before, the two long ones
    took it all for as long as both were prefilling). Each priority has its own oldest long prompt;
    the urgent one goes first."""
    sched = StepPlanner(num_slots=5, capacity=256, token_budget=16, prefill_chunk=8)
    for name, length in (("long-a", 60), ("long-b", 60), ("short", 5)):
        sched.submit(req(name, prompt_len=length, arrival_s=len(sched.requests)))
    plan, _ = fake_step(sched)
    assert [(c.req_id, c.num_tokens) for c in plan.prefill] == [
        ("long-a", 8),
        ("short", 5),
        ("long-b", 3),
    ]
    sched.submit(req("urgent-long", prompt_len=60, priority=-1, arrival_s=10))
    sched.submit(req("short-2", prompt_len=6, arrival_s=11))
    chunks = []
    for _ in range(9):
        plan, _ = fake_step(sched)
        chunks.append([c.req_id for c in plan.prefill])
    # budget used
    assert chunks[:7] == [["urgent-long", "long-a"]] * 6 + [["urgent-long", "long-a", "long-b"]]
    # long-a done: long-b next
    assert chunks[7:] == [["urgent-long", "long-b", "short-2"], ["long-b", "short-2"]]


def test_requests_wait_for_slots_and_finish_by_length_returning_them():
    sched = StepPlanner(num_slots=2, capacity=64, token_budget=64, prefill_chunk=64)
    for name in "abc":
        sched.submit(req(name, prompt_len=4, max_tokens=2))
    plan, finished = fake_step(sched)
    assert {c.req_id for c in plan.chunks} == {"a", "b"} and sched.num_waiting == 1
    plan, finished = fake_step(sched)
    assert sorted(r.req_id for r in finished) == ["a", "b"]
    assert all(r.finish_reason is FinishReason.LENGTH and r.output_ids == [7, 7] for r in finished)
    plan, finished = fake_step(sched)
    assert [c.req_id for c in plan.chunks] == ["c"]
    fake_step(sched)
    assert sched.idle and sorted(sched.free_slots) == [0, 1]


def test_stop_token_finishes_with_stop():
    sched = StepPlanner(num_slots=1, capacity=64)
    sched.submit(req("a", stop_token_ids=frozenset({7})))
    _, finished = fake_step(sched, token=7)
    assert finished[0].finish_reason is FinishReason.STOP and finished[0].output_ids == [7]


def test_abort_in_every_state_returns_the_slot():
    sched = StepPlanner(num_slots=2, capacity=64, token_budget=6, prefill_chunk=6)
    for name in ("decoding", "prefilling", "waiting"):
        sched.submit(req(name, prompt_len=6))
    fake_step(sched)  # "decoding" computes its whole prompt and samples its first token
    fake_step(sched)  # it decodes; "prefilling" gets 5 of its 6 prompt tokens
    state = {r.req_id: r for r in sched.running}
    assert state["decoding"].is_decoding and state["prefilling"].num_computed == 5
    assert [r.req_id for r in sched.waiting_requests()] == ["waiting"]
    for name in ("waiting", "decoding", "prefilling"):
        aborted = sched.abort(name)
        assert (
            aborted.status is RequestStatus.FINISHED and aborted.finish_reason is FinishReason.ABORT
        )
    assert sched.abort("prefilling") is None  # twice is harmless
    assert sched.idle and sorted(sched.free_slots) == [0, 1]
    sched.submit(req("late"))
    plan, _ = fake_step(sched)
    assert [c.req_id for c in plan.chunks] == ["late"]


def test_results_of_an_aborted_request_are_ignored():
    sched = StepPlanner(num_slots=1, capacity=64)
    sched.submit(req("a"))
    plan = sched.plan()
    sched.abort("a")
    assert sched.update(plan, {"a": 3}) == ({}, []) and sched.free_slots == [0]


def test_priority_then_arrival_order_admission():
    sched = StepPlanner(num_slots=1, capacity=64)
    sched.submit(req("low", priority=5))
    sched.submit(req("urgent", priority=-1))
    sched.submit(req("normal"))
    assert [r.req_id for r in sched.waiting_requests()] == ["urgent", "normal", "low"]


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_slots=0, capacity=8),
        dict(num_slots=1, capacity=0),
        dict(num_slots=1, capacity=8, token_budget=0),
        dict(num_slots=1, capacity=8, prefill_chunk=-1),
    ],
)
def test_non_positive_limits_are_rejected(bad):
    with pytest.raises(ValueError, match="must be >= 1"):
        StepPlanner(**bad)


def test_bad_requests_are_rejected_before_any_work():
    with pytest.raises(ValueError, match="prompt is empty"):
        Request(req_id="x", prompt_ids=[], max_tokens=3)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        req("x", max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    sched = StepPlanner(num_slots=1, capacity=16)
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) plus max_tokens \(7\) is 17.*16"):
        sched.submit(req("x", prompt_len=10, max_tokens=7))
    sched.submit(req("ok"))
    with pytest.raises(ValueError, match="already in use"):
        sched.submit(req("ok"))
    assert sched.num_waiting == 1


def test_full_queue_rejects_at_once():
    sched = StepPlanner(num_slots=1, capacity=64, max_waiting=1)
    sched.submit(req("a"))
    with pytest.raises(QueueFullError):
        sched.submit(req("b"))
    assert [r.req_id for r in sched.waiting_requests()] == ["a"]


def test_a_token_sampled_for_a_request_evicted_meanwhile_is_not_taken():
    """With a step in flight, the next plan may evict a request that step samples for: its token is
    dropped (it will be sampled again, with the same seed, when the request is recomputed)."""
    sched = StepPlanner(num_slots=1, capacity=64, token_budget=64, prefill_chunk=64)
    low = req("low", prompt_len=4, max_tokens=10, priority=1)
    sched.submit(low)
    sched.update(sched.plan(), {"low": 5})
    in_flight = sched.plan()  # decodes output 1 of "low"
    assert [(c.req_id, c.output_index) for c in in_flight.decode] == [("low", 1)]
    sched.submit(req("urgent", priority=0))
    assert sched.plan().preempted == ["low"]
    assert sched.update(in_flight, {"low": 9}) == ({}, [])
    assert low.output_ids == [5] and low.num_computed == 0 and low.num_pending == 0


def test_sampling_parameters_go_to_a_worker_once_per_request():
    """Delta step messages: a request's first chunk on a worker carries its sampling parameters,
    later ones do not (the worker keeps them); once it leaves, the next plan tells the worker to
    drop them."""
    sched = StepPlanner(num_slots=2, capacity=64, token_budget=8, prefill_chunk=4)
    sched.submit(req("a", prompt_len=6, max_tokens=3))
    # prompt 4, prompt 2 + first token, then 2 decodes
    plans = [fake_step(sched)[0] for _ in range(4)]
    assert plans[0].chunks[0].sampling == SamplingParams()
    assert [p.chunks[0].sampling for p in plans[1:]] == [None, None, None] and not any(
        p.forget for p in plans
    )
    sched.submit(req("b", prompt_len=2))
    plan, _ = fake_step(sched)
    assert (
        plan.forget == ["a"]
        and plan.chunks[0].req_id == "b"
        and plan.chunks[0].sampling is not None
    )

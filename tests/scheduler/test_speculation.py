"""Speculative decoding in the step planner: n-gram proposals, the configuration's checks, decode
chunks that carry drafts within the budget, max_tokens and the context, and results that take the
accepted run and give back the rejected drafts' positions and blocks."""

import pytest

from scheduler.plan import StepPlan
from scheduler.request import Request, SamplingParams
from scheduler.speculation import NgramIndex, SpeculativeConfig
from scheduler.step_planner import StepPlanner
from tests.scheduler.invariants import check_invariants

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)


def test_a_proposal_is_what_followed_the_latest_earlier_match_of_the_longest_suffix():
    index = NgramIndex(2, 3)
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3])
    # [1, 2, 3] ended at 2 (then 4, 5, ...); [2, 3] ended later, at 7: the longest wins
    assert index.propose(3) == [4, 5, 9]
    index.extend([8])
    assert index.propose(3) == []  # [3, 8] and [2, 3, 8] never occurred before
    index.extend([2, 3])
    assert index.propose(2) == [8, 2]  # [8, 2, 3] is new; [2, 3] last ended at 11, then 8, 2
    assert index.propose(0) == []


def test_a_short_history_proposes_what_it_can():
    index = NgramIndex(1, 4)
    index.extend([5])
    assert index.propose(4) == []
    index.extend([5])
    assert index.propose(4) == [5]  # [5] ended at 0, and 5 followed


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"method": "eagle"}, "proposes with ngram"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "1 <= min <= max"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1"),
        ({"num_spec_tokens": 3}, r"unknown speculative_config keys \['num_spec_tokens'\]"),
    ],
)
def test_a_bad_configuration_is_refused_with_the_reason(values, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(values)


def repeating(req_id: str, max_tokens: int = 40) -> Request:
    """A prompt that repeats itself: its suffix always has an earlier match."""
    return Request(req_id, [7, 8, 9, 10, 11] * 4, max_tokens, SamplingParams())


def planner(**overrides) -> StepPlanner:
    args = dict(num_slots=4, capacity=128, token_budget=64, prefill_chunk=64)
    return StepPlanner(**(args | overrides), speculative=NGRAM)


def decode_once(sched: StepPlanner, req_id: str) -> StepPlan:
    """Prefill the request, take its first token (the prompt's continuation: 7), and plan the
    next step."""
    plan = sched.plan()
    sched.update(plan, {req_id: 7})
    plan = sched.plan()
    check_invariants(sched, plan)
    return plan


def test_a_decode_chunk_carries_the_proposal_and_counts_in_the_budget():
    sched = planner()
    sched.submit(repeating("a"))
    plan = decode_once(sched, "a")
    (chunk,) = plan.decode
    assert chunk.draft == (8, 9, 10, 11) and chunk.token_ids == [7, 8, 9, 10, 11]
    assert chunk.start_pos == 20 and chunk.sample and plan.num_tokens == 5
    request = sched.requests["a"]
    assert request.num_computed == 25 and request.num_pending == 1
    # positions 0..24 have blocks: the drafts' too
    assert len(request.block_table) == 2
    # in flight, it is not planned again: its next chunk waits for the verified run
    assert sched.plan().empty


@pytest.mark.parametrize(("limit", "expected"), [("budget", 2), ("max_tokens", 2), ("k", 4)])
def test_a_draft_stops_at_the_budget_max_tokens_and_k(limit, expected):
    overrides = {"token_budget": 3} if limit == "budget" else {}
    sched = planner(**overrides)
    sched.submit(repeating("a", max_tokens=4 if limit == "max_tokens" else 40))
    plan = sched.plan()
    while plan.prefill:  # a budget of 3: the prompt takes 7 steps
        sched.update(plan, {"a": 7} if plan.prefill[0].sample else {})
        plan = sched.plan()
    (chunk,) = plan.decode
    # budget 3: the token and 2 drafts; max_tokens 4 with 1 out: 1 sampled + 2 drafts accepted
    assert len(chunk.draft) == expected


def test_a_rejected_draft_gives_back_its_positions_and_the_blocks_only_it_held():
    sched = planner(num_blocks=16)
    sched.submit(
        Request("a", [7, 8, 9, 10, 11] * 3 + [7, 8, 9, 10, 11, 7, 8], 40, SamplingParams())
    )
    plan = sched.plan()
    sched.update(plan, {"a": 9})  # positions 0..21 computed; 9 is output 0 at position 22
    plan = sched.plan()
    (chunk,) = plan.decode
    assert chunk.draft == (10, 11, 7, 8) and chunk.start_pos == 22  # positions 23..26 drafted
    request = sched.requests["a"]
    assert len(request.block_table) == 2 and sched.blocks.num_free == 14
    # the worker took 10 (draft 1 matched) and then sampled 3 (draft 2 was 11: rejected)
    update = sched.update(plan, {"a": 10}, more={"a": [3]})
    assert update.accepted == {"a": [10, 3]}
    assert request.output_ids == [9, 10, 3] and request.num_computed == 24
    assert request.num_pending == 0 and request.is_decoding
    assert len(request.block_table) == 2  # positions 0..24 still fit two blocks
    stats = sched.spec_stats.as_dict()
    assert stats["num_drafts"] == 1 and stats["num_draft_tokens"] == 4
    assert stats["num_accepted_tokens"] == 1 and stats["accepted_per_position"] == [1, 0, 0, 0]
    # part of it taken: the next draft may be as long
    assert sched.draft_lens["a"] == 4


def test_drafts_shrink_while_none_is_taken_and_grow_back_when_all_are():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    sched = StepPlanner(4, 128, 64, 64, speculative=config)  # any earlier token matches
    sched.submit(repeating("a", max_tokens=60))
    plan = decode_once(sched, "a")
    lengths = []
    for _ in range(3):  # every draft refused: at most 4, then 2, then 1 (the proposal may be
        (chunk,) = plan.decode  # shorter: what follows its match)
        assert chunk.draft
        sched.update(plan, {"a": 7 if chunk.draft[0] != 7 else 8})
        lengths.append(sched.draft_lens["a"])
        plan = sched.plan()
    assert lengths == [2, 1, 1]
    (chunk,) = plan.decode
    assert len(chunk.draft) == 1
    sched.update(plan, {"a": chunk.draft[0]}, more={"a": [5]})  # all taken: one more
    assert sched.draft_lens["a"] == 2


def test_the_blocks_of_rejected_drafts_past_a_block_boundary_go_back():
    sched = planner(num_blocks=16)
    sched.submit(Request("a", [7, 8, 9, 10, 11] * 3, 40, SamplingParams()))
    plan = sched.plan()
    sched.update(plan, {"a": 7})  # output 0 at position 15, the last of block 0
    plan = sched.plan()
    (chunk,) = plan.decode
    request = sched.requests["a"]
    assert chunk.start_pos == 15 and len(chunk.draft) == 4 and len(request.block_table) == 2
    sched.update(plan, {"a": 5})  # the first draft (8) rejected: 5 sampled instead
    assert request.num_computed == 16 and len(request.block_table) == 2
    assert sched.blocks.num_free == 14


def test_a_stop_inside_an_accepted_run_ends_the_request_there():
    sched = planner()
    request = repeating("a")
    request.stop_token_ids = frozenset({10})
    sched.submit(request)
    plan = decode_once(sched, "a")
    update = sched.update(plan, {"a": 8}, more={"a": [9, 10, 11]})
    assert update.accepted == {"a": [8, 9, 10]} and request.output_ids == [7, 8, 9, 10]
    assert request.finished and [r.req_id for r in update.finished] == ["a"]
    assert sched.blocks.num_free == sched.blocks.num_blocks


def test_a_large_batch_does_not_speculate():
    config = SpeculativeConfig(disable_by_batch_size=2)
    sched = StepPlanner(4, 128, 64, 64, speculative=config)
    for name in "ab":
        sched.submit(repeating(name))
    plan = sched.plan()
    sched.update(plan, {"a": 7, "b": 7})
    plan = sched.plan()
    assert len(plan.decode) == 2 and all(not c.draft for c in plan.decode)

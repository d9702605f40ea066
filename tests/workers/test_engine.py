"""The chapter's milestone: continuous batching changes no request's output."""

import pytest
import torch

from scheduler.request import FinishReason, SamplingParams
from tests.factories import VOCAB, make_requests, run_one_step_ahead, tiny_hf_model
from tests.workers.engines import make_engine


def solo(kind, request, **kw):
    engine = make_engine(kind, num_slots=1, token_budget=512, prefill_chunk=512, **kw)
    return engine.run([request])[request.req_id]


def mixed_requests(**kw):
    return make_requests(
        6, prompt_lens=[5, 31, 12, 47, 9, 20], max_tokens=[17, 6, 25, 9, 3, 12], **kw
    )


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-odd-heads", "mistral"])
def test_batched_greedy_equals_solo_and_transformers_generate(kind):
    eos = frozenset({VOCAB - 1})
    engine = make_engine(kind)
    results = engine.run(mixed_requests(stop_token_ids=eos))
    assert len(results) == 6 and engine.scheduler.idle
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2]  # every slot came back
    hf = tiny_hf_model(kind)
    for request in mixed_requests(stop_token_ids=eos):
        batched = results[request.req_id]
        alone = solo(kind, request)
        assert batched.output_ids == alone.output_ids, request.req_id
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([request.prompt_ids]),
                max_new_tokens=request.max_tokens,
                do_sample=False,
                eos_token_id=VOCAB - 1,
                pad_token_id=0,
            )
        assert batched.output_ids == ref[0, len(request.prompt_ids) :].tolist(), request.req_id
        expected = FinishReason.STOP if batched.output_ids[-1] == VOCAB - 1 else FinishReason.LENGTH
        assert batched.finish_reason is expected
        if expected is FinishReason.LENGTH:
            assert len(batched.output_ids) == request.max_tokens


def test_seeded_sampling_is_the_same_alone_and_in_a_batch():
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7)
    results = make_engine().run(mixed_requests(sampling=params))
    greedy = make_engine().run(mixed_requests())
    for request in mixed_requests(sampling=params):
        assert results[request.req_id].output_ids == solo("llama", request).output_ids
    assert any(results[r].output_ids != greedy[r].output_ids for r in results)  # it did sample


def test_budget_is_never_exceeded_and_decode_comes_first():
    engine = make_engine(num_slots=3, token_budget=10, prefill_chunk=4)
    for request in mixed_requests():
        engine.submit(request)
    mixed_steps = 0
    while not engine.idle:
        # (admission adds none)
        decoding = {r.req_id for r in engine.scheduler.running if r.is_decoding}
        plan = engine.scheduler.plan()
        assert plan.num_tokens <= 10
        assert all(c.num_tokens <= 4 for c in plan.prefill)
        assert all(c.num_tokens == 1 and c.sample for c in plan.decode)
        # every decoding request gets its token before any prompt chunk gets budget, and the flat
        # batch the runner builds puts decode tokens first
        assert {c.req_id for c in plan.decode} == decoding
        assert plan.chunks[: len(plan.decode)] == plan.decode and not decoding & {
            c.req_id for c in plan.prefill
        }
        mixed_steps += bool(plan.decode and plan.prefill)
        engine.scheduler.update(plan, engine.runner.execute(plan).tokens)
    assert mixed_steps > 0  # decode and prefill did share steps


def test_requests_submitted_while_running_arrive_late_and_finish():
    engine = make_engine()
    requests = mixed_requests()
    arrivals = {r.req_id: 0.02 * i for i, r in enumerate(requests)}
    results = engine.run(requests, arrival_s=arrivals)
    for request in mixed_requests():
        assert results[request.req_id].output_ids == solo("llama", request).output_ids
        done = results[request.req_id]
        m = done.metrics()
        assert 0 <= m["ttft_s"] <= m["e2e_s"]
        times = done.token_times_s  # one per token, the first at the first token, in order
        assert (
            len(times) == len(done.output_ids)
            and times[0] == done.first_token_s
            and times == sorted(times)
        )


def test_a_chain_of_requests_each_starts_when_the_one_before_ends_while_the_others_last():
    """A steady population in one process: r0 -> r2 -> r4 is a chain, r1 and r3 the foreground (r3
    arrives late); the chain stops at the first link that would start after both ended."""
    requests = make_requests(5, prompt_lens=[6, 9], max_tokens=[8, 30, 8, 30, 8])
    results = make_engine().run(requests, arrival_s={"r3": 0.05}, after={"r2": "r0", "r4": "r2"})
    assert set(results) <= {"r0", "r1", "r2", "r3", "r4"} and {"r0", "r1", "r2", "r3"} <= set(
        results
    )
    assert results["r2"].arrival_s >= results["r0"].finish_s
    if "r4" in results:  # it started before the foreground ended
        assert results["r4"].arrival_s >= results["r2"].finish_s
        assert results["r4"].arrival_s <= max(results["r1"].finish_s, results["r3"].finish_s)
    for request in make_requests(5, prompt_lens=[6, 9], max_tokens=[8, 30, 8, 30, 8]):
        if request.req_id in results:
            assert results[request.req_id].output_ids == solo("llama", request).output_ids
    long_chain = make_engine().run(
        make_requests(4, [6], [20, 3, 20, 20]), after={"r2": "r0", "r3": "r2"}
    )
    assert set(long_chain) == {"r0", "r1"}  # r1 ended long before r0: nothing followed r0


def priority_requests(sampling=None):
    """Six normal requests for two slots, then two urgent ones that must preempt."""
    normal = make_requests(6, [5, 31, 12, 47, 9, 20], [40, 26, 45, 29, 33, 42], sampling=sampling)
    urgent = make_requests(8, [7, 15], [12, 9], sampling=sampling)[6:]
    for r in normal:
        r.priority = 1
    for r in urgent:
        r.priority = 0
    return normal, urgent


@pytest.mark.parametrize(
    "sampling", [None, SamplingParams(temperature=0.8, top_k=30, seed=5)], ids=["greedy", "seeded"]
)
def test_preempted_requests_produce_their_solo_outputs(sampling):
    engine = make_engine(num_slots=2, token_budget=16, prefill_chunk=8)
    normal, urgent = priority_requests(sampling)
    by_id = {r.req_id: r for r in normal + urgent}
    for request in normal:
        engine.submit(request)
    finished = {}
    for step in range(400):
        if step in (10, 25):  # urgent requests arrive mid-run, when both slots are busy
            engine.submit(urgent[step == 25])
        for out in engine.step():
            if out.finished:
                finished[out.req_id] = by_id[out.req_id]
        if engine.idle and len(finished) == 8:
            break
    assert len(finished) == 8 and sorted(engine.scheduler.free_slots) == [0, 1]
    assert engine.scheduler.num_preemptions >= 2
    assert sum(r.num_preemptions for r in finished.values()) == engine.scheduler.num_preemptions
    assert all(r.metrics()["preemptions"] == r.num_preemptions for r in finished.values())
    alone_normal, alone_urgent = priority_requests(sampling)
    for request in alone_normal + alone_urgent:
        assert finished[request.req_id].output_ids == solo("llama", request).output_ids, (
            request.req_id
        )


@pytest.mark.parametrize(
    "sampling", [None, SamplingParams(temperature=0.8, top_k=30, seed=5)], ids=["greedy", "seeded"]
)
def test_planning_one_step_ahead_changes_no_output(sampling):
    """What the Ray loop does: step N+1 is planned and run before step N's tokens are applied; the
    runner feeds in the tokens it sampled (PENDING in the plan). Outputs equal the solo runs, stop
    ids included."""
    # r2 stops early
    stop = frozenset({solo("llama", mixed_requests(sampling=sampling)[2]).output_ids[4]})
    requests = mixed_requests(sampling=sampling, stop_token_ids=stop)
    engine = make_engine(num_slots=3, token_budget=10, prefill_chunk=4)
    sched, runner = engine.scheduler, engine.runner
    for request in requests:
        sched.submit(request)
    assert run_one_step_ahead(sched, runner)
    for request in mixed_requests(sampling=sampling, stop_token_ids=stop):
        got = next(r for r in requests if r.req_id == request.req_id)
        expected = solo("llama", request)
        assert (
            got.output_ids == expected.output_ids and got.finish_reason == expected.finish_reason
        ), request.req_id
    assert any(r.finish_reason is FinishReason.STOP for r in requests)


def test_a_batch_with_an_id_twice_is_refused_before_anything_runs():
    engine = make_engine()
    first, second = mixed_requests()[:2]
    second.req_id = first.req_id
    with pytest.raises(ValueError, match="already in use"):
        engine.run([first, second])
    assert engine.scheduler.idle and engine.num_steps == 0


def test_a_request_that_already_ran_is_refused_rather_than_taken_for_progress():
    engine = make_engine()
    request = mixed_requests()[0]
    assert engine.run([request])[request.req_id].output_ids  # it ran: its state is its end
    steps = engine.num_steps
    with pytest.raises(ValueError, match="has already run.*submit a new Request"):
        engine.run([request])
    assert engine.scheduler.idle and engine.num_steps == steps

"""A tensor-parallel worker of two ranks (this process as rank 0, one Ray actor as rank 1, gloo,
one thread each) serves requests as a TP-1 one does: the same greedy and seeded tokens, log-probs
within 1e-4."""

import torch

from scheduler.request import SamplingParams
from scheduler.step_planner import StepPlanner
from tests.factories import make_requests, run_one_step_ahead
from workers.engine import LocalEngine
from workers.loader import load_model
from workers.runner import ModelRunner

NUM_SLOTS = 3
CAPACITY = 128
NUM_BLOCKS = NUM_SLOTS * CAPACITY // 16


def _requests(prefix: str = ""):
    greedy = make_requests(4, [9, 30, 17], [12, 5, 20], SamplingParams(logprobs=2))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    requests = greedy + make_requests(2, [21], [10], seeded)
    for i, request in enumerate(requests):
        request.req_id = f"{prefix}{i}"
    return requests


def _serve(runner):
    """Requests served by `runner` as `local` mode does, then as the Ray loop does (each step
    planned before the last one's tokens are applied: the runner feeds in what it sampled); the
    finished requests of both, by id."""
    planner = StepPlanner(NUM_SLOTS, CAPACITY, 16, 8, num_blocks=NUM_BLOCKS)
    finished = LocalEngine(runner, planner).run(_requests())
    planner = StepPlanner(NUM_SLOTS, CAPACITY, 16, 8, num_blocks=NUM_BLOCKS)
    ahead = _requests("ahead-")
    for request in ahead:
        planner.submit(request)
    assert run_one_step_ahead(planner, runner)
    return finished | {r.req_id: r for r in ahead}


def test_tp2_worker_serves_tp1s_tokens(ray_session, uneven_checkpoint):
    from workers.tp_group import TPFollowers

    torch.set_num_threads(1)
    ref = _serve(ModelRunner(load_model(uneven_checkpoint, "float32", "cpu").model, NUM_BLOCKS))
    followers = TPFollowers.start(2, uneven_checkpoint, "float32", "cpu", 1)
    try:
        model = load_model(uneven_checkpoint, "float32", "cpu", tp_size=2, tp_rank=0).model
        (follower,) = followers.start_runners(NUM_BLOCKS, 16, "auto")
        runner = ModelRunner(model, NUM_BLOCKS, followers=followers)
        got = _serve(runner)
    finally:
        followers.shutdown()
    # rank 1 ran this worktree's code, on one thread, with the third KV head only
    assert follower["code"] == str(__import__("workers").__path__[0])
    assert (follower["threads"], follower["kv_heads"]) == (1, 1)
    assert runner.cache.k.shape[2] == 2  # rank 0: the first two KV groups
    assert got.keys() == ref.keys()
    for req_id, request in ref.items():
        assert got[req_id].output_ids == request.output_ids, req_id
        assert got[req_id].finish_reason is request.finish_reason
        for mine, theirs in zip(got[req_id].logprobs, request.logprobs, strict=True):
            assert mine.token_id == theirs.token_id
            assert abs(mine.logprob - theirs.logprob) < 1e-4
    assert any(len(set(r.output_ids)) > 3 for r in ref.values())

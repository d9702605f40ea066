"""Random cells under load and faults: every stream whole and exact, everything given back.

Each case draws a cell (colocated or disaggregated, one to three decode workers, pools of one to
three requests' worth of blocks, prefix caching or not, short prompts prefilled locally or not)
and a workload (shared prefixes, priorities, n > 1 choices, requests arriving in waves), then
steps it as the Ray loop does, one call in flight per worker (a call of up to four decode steps
when it may burst), while requests are aborted, KV imports lost, workers die and come back, and
workers move between the pools.
The fake workers of `test_coordinator` check every row each chunk reads, so a block shared,
reused or imported wrongly fails here.
"""

import random

import pytest

from scheduler.cell.bursts import plan_call
from scheduler.cell.state import WorkerStatus
from scheduler.request import Request
from tests.factories import prompt_ids
from tests.scheduler.cell.cells import (
    Streams,
    assert_idle,
    cell,
    expected_tokens,
    fake_step,
)


def workload(rng: random.Random, seed: int) -> list[Request]:
    system = prompt_ids(rng.randint(1, 50), seed)
    requests = []
    for i in range(rng.randint(2, 10)):
        shared = system if rng.random() < 0.6 else []
        prompt = shared + prompt_ids(rng.randint(1, 40), rng.randrange(10**6))
        request = Request(
            req_id=f"r{i}",
            prompt_ids=prompt,
            max_tokens=rng.randint(1, 30),
            priority=rng.choice([0, 0, 1]),
        )
        requests.append(request)
        if rng.random() < 0.15:  # a second choice of the same prompt
            requests.append(
                Request(
                    req_id=f"r{i}-1",
                    prompt_ids=list(prompt),
                    max_tokens=request.max_tokens,
                    priority=request.priority,
                    fork_of=request.req_id,
                )
            )
    return requests


def random_cell(rng: random.Random, requests: list[Request]):  # type: ignore[no-untyped-def]
    block_size = rng.choice([1, 4, 8, 16])
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    capacity = -(-longest // block_size) * block_size
    one = capacity // block_size + 1  # the blocks of one request of the longest
    budget = rng.choice([8, 24, 64])
    return cell(
        mode=rng.choice(["colocated", "disaggregated"]),
        num_decode_workers=rng.randint(1, 3),
        num_prefill_workers=rng.randint(1, 2),
        decode_slots=rng.randint(1, 4),
        prefill_slots=rng.randint(1, 3),
        capacity=capacity,
        token_budget=budget,
        prefill_chunk=rng.choice([c for c in (1, 5, 8, 16) if c <= budget]),
        decode_blocks=one + rng.randint(0, 2 * one),
        prefill_blocks=one + rng.randint(0, 2 * one),
        block_size=block_size,
        prefix_caching=rng.random() < 0.7,
        max_recomputes=50,
        local_prefill_max_tokens=rng.choice([0, 0, 20]),
    )


class Faults:
    """Each round: a live worker dies (never the last of its kind) with probability `death`,
    a dead one comes back with probability `back`, and a worker starts moving to the other pool
    (never the last that takes work in its own) with probability `move`; the first import of
    each request in `lose` is lost."""

    def __init__(self, rng: random.Random, lose: set[str], death: float, move: float) -> None:
        self.rng, self.lose, self.death, self.back, self.move = rng, lose, death, 0.1, move
        self.dead: list = []

    def kill(self, coordinator, worker, streams) -> bool:  # type: ignore[no-untyped-def]
        alike = [w for w in coordinator.workers if w.kind == worker.kind]
        if self.rng.random() >= self.death or sum(w.status is WorkerStatus.UP for w in alike) < 2:
            return False
        streams.in_flight.pop(worker.name, None)  # its step's results are lost with it
        coordinator.worker_died(worker)
        self.dead.append(worker)
        streams.take(coordinator)
        return True

    def revive(self, coordinator) -> None:  # type: ignore[no-untyped-def]
        for worker in list(self.dead):
            if self.rng.random() < self.back:
                self.dead.remove(worker)
                coordinator.worker_back(worker, {"pid": self.rng.randrange(10**6)})

    def change_roles(self, coordinator) -> None:  # type: ignore[no-untyped-def]
        if coordinator.config.mode != "disaggregated" or self.rng.random() >= self.move:
            return
        movable = [
            w
            for w in coordinator.workers
            if w.status is WorkerStatus.UP
            and w.next_kind is None
            and sum(o.accepts for o in coordinator.workers if o.kind == w.kind) > 1
        ]
        if movable:
            worker = self.rng.choice(movable)
            coordinator.roles.begin(worker, "decode" if worker.kind == "prefill" else "prefill")


def call(coordinator, worker, burst: int, lose: set[str]) -> list:  # type: ignore[no-untyped-def]
    """A call's plans (`plan_call`), each with the fake worker's result, worked out as it is
    planned (a later plan of the burst may evict a request an earlier one runs)."""
    results = []
    next_step = coordinator.next_step

    def answered(worker):  # type: ignore[no-untyped-def]
        step = next_step(worker)
        if step is not None:
            result = fake_step(coordinator, worker, *step, lose_imports=lose)
            lose.difference_update(result.failed_imports)
            results.append(result)
        return step

    coordinator.next_step = answered
    try:
        planned = plan_call(coordinator, worker, burst)
    finally:
        coordinator.next_step = next_step
    return [] if planned is None else list(zip(planned[0], results, strict=True))


def run(coordinator, streams, faults: Faults, burst: int, rounds: int) -> None:  # type: ignore[no-untyped-def]
    """Step every live worker `rounds` times (or until all is done), one call in flight each."""
    in_flight = streams.in_flight
    for _ in range(rounds):
        for worker in coordinator.workers:
            if worker.status is not WorkerStatus.UP or faults.kill(coordinator, worker, streams):
                continue
            sent = call(coordinator, worker, burst, faults.lose)
            for plan, result in in_flight.pop(worker.name, []):
                coordinator.apply(worker, plan, result)
            streams.take(coordinator)
            if sent:
                in_flight[worker.name] = sent
        faults.revive(coordinator)
        faults.change_roles(coordinator)
        idle = all(w.step_planner.idle for w in coordinator.workers)
        if not in_flight and not faults.dead and idle:
            return


@pytest.mark.parametrize("first", range(0, 200, 50))
def test_random_cells_under_faults_give_every_stream_whole(first):
    for seed in range(first, first + 50):
        rng = random.Random(seed)
        requests = workload(rng, seed)
        coordinator, streams = random_cell(rng, requests), Streams()
        lose = {r.req_id for r in requests if rng.random() < 0.2}
        faults = Faults(
            rng, lose, death=rng.choice([0, 0.002, 0.01]), move=rng.choice([0, 0.02, 0.1])
        )
        burst = rng.choice([1, 1, 2, 4])
        waves = list(requests)
        while waves:
            size = rng.randint(1, 5)
            while size < len(waves) and waves[size].fork_of is not None:
                size += 1  # a choice arrives with its sibling
            for request in waves[:size]:
                coordinator.admit(request, consumer="c")
            waves = waves[size:]
            run(coordinator, streams, faults, burst, rng.randint(1, 30))
            live = [r for r in requests if r.req_id not in streams.finish and r not in waves]
            if live and rng.random() < 0.3:
                coordinator.abort(rng.choice(live).req_id)
                streams.take(coordinator)
        faults.death, faults.back, faults.move = 0.0, 1.0, 0.0
        run(coordinator, streams, faults, burst, 20_000)
        for request in requests:
            tokens = streams.tokens.get(request.req_id, [])
            expected = expected_tokens(request.req_id, request.max_tokens)
            if streams.finish.get(request.req_id) == "abort":
                assert tokens == expected[: len(tokens)], (seed, request.req_id)
            else:
                assert streams.finish.get(request.req_id) == "length", (seed, request.req_id)
                assert tokens == expected, (seed, request.req_id)
        assert_idle(coordinator)

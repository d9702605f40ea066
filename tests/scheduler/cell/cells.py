"""A cell of fake workers for the coordinator's tests, without Ray or a model.

A fake worker answers each plan at once: the token it samples for output index i of a request
depends only on (request, i), as seeded sampling does, so a recomputed request must continue with
exactly the tokens it would have had, and every test can check the streams are whole. A fake decode
worker also keeps a ledger of what each position of each KV block holds (imported pieces, copies,
computed rows) and checks that every chunk it runs finds its request's rows before it, through its
block table: a handoff imported into the wrong blocks, a piece missing or imported twice from a void
attempt, a block shared or reused while another request still reads it fails every test that
steps.
"""

import functools
import weakref

from scheduler.cell.coordinator import Coordinator
from scheduler.cell.metrics import RecordingBackend
from scheduler.cell.state import CellConfig, WorkerStatus
from scheduler.messages import KVPiece, Samples, StepResult
from scheduler.plan import StepPlan
from scheduler.request import RequestStatus
from tests.factories import make_request


def token(req_id: str, index: int) -> int:
    return (sum(map(ord, req_id)) * 31 + index * 7) % 97 + 1


def expected_tokens(req_id: str, max_tokens: int) -> list[int]:
    return [token(req_id, i) for i in range(max_tokens)]


req = functools.partial(make_request, prompt_len=6, max_tokens=5)


# decode worker -> block -> offset -> row
LEDGER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# (plan, request) -> what a chunk found wrong in the rows before it; the worker then wrote garbage.
# Only a chunk whose result the scheduler then uses must have read right rows: one sent before
# the scheduler heard that its request's import was lost is void.
WRONG: dict[tuple[int, str], tuple[StepPlan, str]] = {}  # (the plan kept: its id stays its own)
GARBAGE = ("garbage",)


class Checked(Coordinator):
    def worker_died(self, worker):
        LEDGER.pop(worker, None)  # its restart comes back with an empty cache
        super().worker_died(worker)

    def apply(self, worker, plan, result):
        for chunk in plan.chunks:
            plan_wrong = WRONG.pop((id(plan), chunk.req_id), None)
            wrong = None if plan_wrong is None else plan_wrong[1]
            request = worker.step_planner.requests.get(chunk.req_id)
            used = (
                request is not None
                and request.status is RequestStatus.RUNNING
                and chunk.admission == request.num_admissions
                and chunk.req_id not in result.failed_imports
            )
            assert wrong is None or not used, wrong
        super().apply(worker, plan, result)


def cell(mode="disaggregated", **kw):
    config = (
        dict(
            mode=mode,
            num_decode_workers=1,
            num_prefill_workers=1,
            decode_slots=2,
            prefill_slots=1,
            capacity=64,
            token_budget=8,
            prefill_chunk=4,
        )
        | kw
    )
    return Checked(CellConfig(**config), metrics_backend=RecordingBackend())


def row(request, position):
    """What a correct cache holds at a request's position: the KV of the tokens 0..position of its
    sequence (so requests and choices that share a prefix share its rows)."""
    num_prompt = len(request.prompt_ids)
    outputs = [token(request.req_id, i) for i in range(max(0, position + 1 - num_prompt))]
    return tuple(request.prompt_ids[: position + 1] + outputs)


class Rows:
    """A fake KV piece's object: the rows it carries."""

    def __init__(self, rows):
        self.rows = rows


def fake_step(coordinator, worker, plan, imports, lose_imports=()):
    """What a worker would return: a token per sampling chunk; prefill workers export handoffs."""
    # dropped from the step
    lost = {i.handoff.req_id for i in imports if i.handoff.req_id in lose_imports}
    sampled = {
        c.req_id: token(c.req_id, c.output_index)
        for c in plan.chunks
        if c.sample and c.req_id not in lost
    }
    if worker.kind == "prefill":  # a piece per export, 1000 bytes per request in its last one
        requests = worker.step_planner.requests
        pieces = [
            KVPiece(
                r,
                first,
                end - first,
                Rows([row(requests[r], p) for p in range(first, end)]),
                0 if end < requests[r].num_tokens else 1000,
                0.001,
            )
            for r, _, first, end in plan.exports
        ]
        return StepResult(Samples(sampled), kv_pieces=pieces, step_s=0.01, forward_s=0.009)
    check_blocks(worker, plan, [i for i in imports if i.handoff.req_id not in lost], lost)
    return StepResult(
        Samples(sampled),
        failed_imports=sorted(lost),
        import_s={
            i.handoff.req_id: 0.002 for i in imports if i.handoff.req_id not in lost and i.final
        },
        step_s=0.01,
        forward_s=0.009,
    )


def check_blocks(worker, plan, imports, lost):
    """Apply a decode step to the worker's ledger: imports, copies, then each chunk (but those of
    the requests whose import was lost: the worker drops them), which should find its request's
    rows at every position before its own. One that does not writes garbage rows, and its result
    must be void when it is applied (`Checked.apply`): sent before the scheduler heard that its
    request's import was lost."""
    blocks = LEDGER.setdefault(worker, {})
    size = worker.step_planner.blocks.block_size

    def put(table, position, held):
        blocks.setdefault(table[position // size], {})[position % size] = held

    def get(table, position):
        return blocks.get(table[position // size], {}).get(position % size)

    for item in imports:  # as the worker does: positions before `held` are not copied
        for piece in item.handoff.pieces[item.handoff.imported :]:
            for i, held in enumerate(piece.ref.rows):
                if piece.start + i >= item.held:
                    put(item.block_table, piece.start + i, held)
    for source, target in plan.copies:
        blocks[target] = dict(blocks.get(source, {}))
    for chunk in (c for c in plan.chunks if c.req_id not in lost):
        table = chunk.block_table
        request = worker.step_planner.requests[chunk.req_id]
        wrong = [p for p in range(chunk.start_pos) if get(table, p) != row(request, p)]
        if wrong:
            WRONG[id(plan), chunk.req_id] = (
                plan,
                f"{chunk.req_id} (blocks {table}) finds wrong rows at positions {wrong}",
            )
        for p in range(chunk.start_pos, chunk.start_pos + chunk.num_tokens):
            put(table, p, GARBAGE if wrong else row(request, p))


class Streams:
    """What each consumer's streams received, checked to be whole: no token twice, one final
    output."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.errors: dict[str, str | None] = {}
        # worker name -> (plan, result) sent and not yet applied (run_overlapped)
        self.in_flight: dict = {}

    def take(self, coordinator):
        for outputs in coordinator.take_outputs().values():
            for out in outputs:
                assert out.req_id not in self.finish, f"{out.req_id} got output after it finished"
                self.tokens.setdefault(out.req_id, []).extend(out.token_ids)
                if out.finished:
                    self.finish[out.req_id], self.errors[out.req_id] = out.finish_reason, out.error


def record_steps(coordinator, seen):
    """Call `seen(worker, plan, imports)` with every step the coordinator plans from now on."""
    next_step = coordinator.next_step

    def recorded(worker):
        step = next_step(worker)
        if step is not None:
            seen(worker, *step)
        return step

    coordinator.next_step = recorded


def step_all(coordinator, streams, steps=200, lose_imports=(), before_step=None, observe=None):
    for n in range(steps):
        if before_step is not None:
            before_step(n)
        busy = False
        for worker in coordinator.workers:
            if worker.status is not WorkerStatus.UP:
                continue
            step = coordinator.next_step(worker)
            if step is None:
                continue
            busy = True
            plan, imports = step
            result = fake_step(coordinator, worker, plan, imports, lose_imports)
            coordinator.apply(worker, plan, result)
            if observe is not None:  # after each step: what it imported and what it returned
                observe(worker, imports, result)
            streams.take(coordinator)
        streams.take(coordinator)
        if not busy and before_step is None:
            return n
    return steps


def assert_idle(coordinator):
    assert not coordinator.kv.handoffs and not coordinator.kv.pieces and not coordinator.kv.bound
    assert not coordinator.kv.importing
    assert not coordinator.consumers
    assert not coordinator.records
    assert all(w.slots_used == 0 and w.step_planner.num_waiting == 0 for w in coordinator.workers)


def run_overlapped(coordinator, streams, steps=400, lose_once=(), final_only=False):
    """Each worker keeps one step in flight: step N+1 is planned before step N's results are
    applied. What is still in flight when `steps` run out stays in flight for the next call. The
    first import of each request in `lose_once` (its final one, with `final_only`) is lost."""
    in_flight = streams.in_flight
    lose = set(lose_once)
    for _ in range(steps):
        for worker in coordinator.workers:
            step = coordinator.next_step(worker)
            sent = None
            if step is not None:
                imports = step[1]
                lost = {i.handoff.req_id for i in imports if i.final or not final_only} & lose
                sent = (step[0], fake_step(coordinator, worker, *step, lose_imports=lost))
                lose -= lost
            if worker.name in in_flight:
                coordinator.apply(worker, *in_flight.pop(worker.name))
                streams.take(coordinator)
            if sent is not None:
                in_flight[worker.name] = sent
        if not in_flight and all(w.step_planner.idle for w in coordinator.workers):
            return

"""Calls to scheduler actors: the requests that reach the driver or an ingress together go in one
submission per scheduler, and the ingress places requests on running cells only, elsewhere when one
refuses (fake scheduler handles; no Ray, no Serve)."""

import asyncio

import pytest

from deploy.engine_client import EngineClient, complete
from deploy.serving import cell_choice
from deploy.serving.cells import ServeCells
from deploy.submissions import Submissions
from scheduler.cell.state import CellClosed
from scheduler.outputs import RequestOutput
from scheduler.request import Request
from scheduler.step_planner import QueueFullError
from tests.waiting import wait_for_async


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return asyncio.ensure_future(self.fn(*args, **kwargs))


class FakeScheduler:
    """Answers `submit_many` after a little while; a request ends when the test says so."""

    def __init__(self, full=(), closed=False):
        self.submissions, self.live, self.full, self.dead, self.closed = (
            [],
            set(),
            set(full),
            False,
            closed,
        )
        self.submit_many = _Method(self._submit_many)
        self.aborted = []
        self.abort = _Method(self._abort)

    async def _submit_many(self, entries):
        self.submissions.append([r.req_id for r, _ in entries])
        await asyncio.sleep(0.01)
        if self.dead:
            raise RuntimeError("the scheduler died")
        answers = []
        for request, _ in entries:
            if self.closed:
                answers.append(CellClosed("draining"))
            elif request.req_id in self.full:
                answers.append(QueueFullError("too many waiting"))
            else:
                self.live.add(request.req_id)
                answers.append("instance-1")
        return answers

    async def _abort(self, req_id):
        self.aborted.append(req_id)
        self.live.discard(req_id)


def serve_cells(schedulers, live):
    """`ServeCells` of app "app" over fake schedulers by cell, with Serve's list of running cells
    `live`."""
    cell_choice.set_live("app", live)
    cells = ServeCells(handle=None, app_name="app", failover_timeout_s=5.0)

    async def connect(cell):
        return schedulers[cell], Submissions(schedulers[cell])

    cells._connect = connect
    return cells


def request(i):
    return Request(req_id=f"q{i}", prompt_ids=[1, 2, 3], max_tokens=2)


def test_requests_that_arrive_together_share_a_submission_and_a_refusal_is_theirs_alone():
    async def main():
        scheduler = FakeScheduler(full={"q3"})
        submissions = Submissions(scheduler)
        first = asyncio.ensure_future(submissions.submit(request(0), "c"))
        # the first goes at once; the next four wait for its answer, then go together
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(submissions.submit(request(i), "c")) for i in range(1, 5)]
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
        assert scheduler.submissions == [["q0"], ["q1", "q2", "q3", "q4"]]
        assert answers[:3] == ["instance-1"] * 3 and answers[4] == "instance-1"
        assert isinstance(answers[3], QueueFullError)

    asyncio.run(main())


def test_a_request_given_up_before_submission_is_never_sent_and_one_on_its_way_is_aborted():
    async def main():
        scheduler = FakeScheduler()
        submissions = Submissions(scheduler)
        on_its_way = asyncio.ensure_future(submissions.submit(request(0), "c"))
        await asyncio.sleep(0)  # (a turn of the loop, not a duration: q0 queued)
        queued = asyncio.ensure_future(submissions.submit(request(1), "c"))
        await asyncio.sleep(0)  # q0 sent, q1 queued behind it
        queued.cancel()
        on_its_way.cancel()
        await submissions.sender  # the sending ended: nothing more leaves
        await wait_for_async(lambda: scheduler.aborted, 5)
        assert scheduler.submissions == [["q0"]]  # q1 never left
        # q0 was queued there: aborted behind it
        assert scheduler.aborted == ["q0"] and not scheduler.live

    asyncio.run(main())


def test_a_lost_scheduler_fails_every_submission_of_its_call():
    async def main():
        scheduler = FakeScheduler()
        scheduler.dead = True
        submissions = Submissions(scheduler)
        answers = await asyncio.gather(
            *(submissions.submit(request(i), "c") for i in range(3)), return_exceptions=True
        )
        assert all(isinstance(a, RuntimeError) for a in answers)

    asyncio.run(main())


def test_the_driver_submits_a_burst_in_one_call_and_streams_every_request():
    """`EngineClient` over one scheduler actor (the batch job, the benchmark): 20 requests at once
    cost one submission, not 20 calls, and each stream gets its own outputs."""

    async def main():
        scheduler = FakeScheduler()

        async def poll(consumer, timeout_s=1.0):
            await asyncio.sleep(0.005)  # a step's time
            done = sorted(scheduler.live)
            scheduler.live -= set(done)
            return "instance-1", [
                RequestOutput(r, token_ids=[int(r[1:])], finish_reason="length") for r in done
            ]

        scheduler.poll = _Method(poll)
        client = EngineClient(scheduler)
        completions = await asyncio.gather(*(complete(client, request(i)) for i in range(20)))
        assert [c.token_ids for c in completions] == [[i] for i in range(20)]
        assert scheduler.submissions == [[f"q{i}" for i in range(20)]]

    asyncio.run(main())


def test_a_burst_goes_in_one_call_per_cell_and_a_refused_request_goes_to_a_running_cell():
    async def main():
        a, b = FakeScheduler(), FakeScheduler()
        cells = serve_cells({"a": a, "b": b}, live=["a"])
        placed = await asyncio.gather(*(cells.place(request(i), "c") for i in range(10)))
        assert {p.replica for p in placed} == {"a"} and a.submissions == [
            [f"q{i}" for i in range(10)]
        ]
        # a drains (Serve no longer lists it, but this ingress may not know yet); b starts a little
        # later
        a.closed = True
        asyncio.get_running_loop().call_later(0.2, lambda: cell_choice.set_live("app", ("a", "b")))
        moved = await cells.place(request(10), "c")
        assert moved.replica == "b" and a.submissions[-1] == ["q10"] and b.submissions == [["q10"]]
        assert "a" in cells.gone  # avoided a while, though Serve still lists it
        assert (await cells.place(request(11), "c")).replica == "b"
        # a request the engine refuses fails at once (a continuation would wait for room instead)
        b.full.add("q12")
        with pytest.raises(QueueFullError):
            await cells.place(request(12), "c")
        # load: the open requests of each cell; an ended one no longer counts
        assert cells.where == {f"q{i}": "a" for i in range(10)} | {"q10": "b", "q11": "b"}
        assert cells.load == {"a": 10, "b": 2}
        cells.done("q10")
        assert "q10" not in cells.where and cells.load == {"a": 10, "b": 1}

    asyncio.run(main())


def test_a_lost_stream_goes_back_to_its_restarted_scheduler_when_no_other_cell_runs():
    """One cell: its scheduler restarted (the stream was lost there), then its replica died too and
    Serve lists none; the continuation goes back to the same scheduler both times, and a new
    request may use the cell again at once."""

    async def main():
        a, b = FakeScheduler(), FakeScheduler()
        cells = serve_cells({"a": a, "b": b}, live=["a"])
        first = await cells.place(request(0), "c")
        cells.lost(first)
        assert "a" in cells.gone
        # the only running cell: tried again though it was just lost
        again = await cells.place(request(0), "c", failing_over=True)
        assert again.replica == "a" and a.submissions == [["q0"], ["q0"]]
        assert "a" not in cells.gone  # it answered
        assert (await cells.place(request(1), "c")).replica == "a"
        # its replica is gone and no other is listed yet: the continuation still reaches it
        cells.lost(again)
        cell_choice.set_live("app", ())
        back = await cells.place(request(0), "c", failing_over=True)
        assert back.replica == "a" and a.submissions[-1] == ["q0"] and b.submissions == []
        # a new request waits for a running cell (none: it gives up after the timeout)
        cells.failover_timeout_s = 0.3
        with pytest.raises(RuntimeError, match="no cell is running"):
            await cells.place(request(2), "c")

    asyncio.run(main())


def test_a_lost_cell_is_avoided_while_another_runs():
    async def main():
        a, b = FakeScheduler(), FakeScheduler()
        cells = serve_cells({"a": a, "b": b}, live=["a", "b"])
        cells.chooser.choose = lambda req, choices, load: choices[0]
        first = await cells.place(request(0), "c")
        assert first.replica == "a"
        cells.lost(first)
        assert (await cells.place(request(0), "c", failing_over=True)).replica == "b"
        assert (await cells.place(request(1), "c")).replica == "b"

    asyncio.run(main())

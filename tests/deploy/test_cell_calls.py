"""Calls to a scheduler actor: the requests that reach a cell replica or the driver together go in one
submission, and one call at a time asks which of a replica's requests ended (a fake scheduler handle;
no Ray, no Serve)."""

import asyncio

import pytest

from deploy.engine_client import EngineClient, complete
from deploy.serving.cells import Cell
from deploy.submissions import Submissions
from scheduler.outputs import RequestOutput
from scheduler.policy import QueueFullError
from scheduler.request import Request


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


class FakeScheduler:
    """Answers `submit_many` after a little while; a request ends when the test says so."""

    def __init__(self, full=()):
        self.submissions, self.asked, self.live, self.full, self.dead = [], [], set(), set(full), False
        self.submit_many, self.wait_ended = _Method(self._submit_many), _Method(self._wait_ended)
        self.aborted = []
        self.abort = _Method(self._abort)

    async def _submit_many(self, entries):
        self.submissions.append([r.req_id for r, _ in entries])
        await asyncio.sleep(0.01)
        if self.dead:
            raise RuntimeError("the scheduler died")
        answers = []
        for request, _ in entries:
            if request.req_id in self.full:
                answers.append(QueueFullError("too many waiting"))
            else:
                self.live.add(request.req_id)
                answers.append("instance-1")
        return answers

    async def _wait_ended(self, req_ids, timeout_s=2.0):
        self.asked.append(list(req_ids))
        for _ in range(100):
            if self.dead:
                raise RuntimeError("the scheduler died")
            gone = [r for r in req_ids if r not in self.live]
            if gone:
                return gone
            await asyncio.sleep(0.005)
        return []

    async def _abort(self, req_id):
        self.aborted.append(req_id)
        self.live.discard(req_id)


def cell(scheduler):
    replica = object.__new__(Cell.func_or_class)
    replica.scheduler, replica.replica = scheduler, "r1"
    replica.submissions, replica.running, replica.watcher = Submissions(scheduler), {}, None
    return replica


def request(i):
    return Request(req_id=f"q{i}", prompt_ids=[1, 2, 3], max_tokens=2)


def test_requests_that_arrive_together_share_a_submission_and_a_refusal_is_theirs_alone():
    async def main():
        scheduler = FakeScheduler(full={"q3"})
        submissions = Submissions(scheduler)
        first = asyncio.ensure_future(submissions.submit(request(0), "c"))
        await asyncio.sleep(0)  # the first goes at once; the next four wait for its answer, then go together
        rest = [asyncio.ensure_future(submissions.submit(request(i), "c")) for i in range(1, 5)]
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
        assert scheduler.submissions == [["q0"], ["q1", "q2", "q3", "q4"]]
        assert answers[:3] == ["instance-1"] * 3 and answers[4] == "instance-1"
        assert isinstance(answers[3], QueueFullError)

    asyncio.run(main())


def test_a_request_given_up_before_its_submission_left_is_never_sent_and_one_on_its_way_is_aborted():
    async def main():
        scheduler = FakeScheduler()
        submissions = Submissions(scheduler)
        on_its_way = asyncio.ensure_future(submissions.submit(request(0), "c"))
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(submissions.submit(request(1), "c"))
        await asyncio.sleep(0)
        queued.cancel()
        on_its_way.cancel()
        await asyncio.sleep(0.03)
        assert scheduler.submissions == [["q0"]]  # q1 never left
        assert scheduler.aborted == ["q0"] and not scheduler.live  # q0 was queued there: aborted behind it

    asyncio.run(main())


def test_a_lost_scheduler_fails_every_submission_of_its_call():
    async def main():
        scheduler = FakeScheduler()
        scheduler.dead = True
        submissions = Submissions(scheduler)
        answers = await asyncio.gather(*(submissions.submit(request(i), "c") for i in range(3)),
                                       return_exceptions=True)
        assert all(isinstance(a, RuntimeError) for a in answers)

    asyncio.run(main())


def test_the_driver_submits_a_burst_in_one_call_and_streams_every_request():
    """`EngineClient` over one scheduler actor (the batch job, the benchmark): 20 requests at once cost
    one submission, not 20 calls, and each stream gets its own outputs."""
    async def main():
        scheduler = FakeScheduler()

        async def poll(consumer, timeout_s=1.0):
            await asyncio.sleep(0.005)
            done = sorted(scheduler.live)
            scheduler.live -= set(done)
            return "instance-1", [RequestOutput(r, token_ids=[int(r[1:])], finish_reason="length") for r in done]

        scheduler.poll = _Method(poll)
        client = EngineClient(scheduler)
        completions = await asyncio.gather(*(complete(client, request(i)) for i in range(20)))
        assert [c.token_ids for c in completions] == [[i] for i in range(20)]
        assert scheduler.submissions == [[f"q{i}" for i in range(20)]]

    asyncio.run(main())


def test_one_call_at_a_time_watches_every_request_and_a_lost_scheduler_ends_them_all():
    async def main():
        scheduler = FakeScheduler()
        replica = cell(scheduler)
        scheduler.live |= {"a", "b", "c"}
        waits = {r: asyncio.ensure_future(replica._ended(r)) for r in ("a", "b")}
        await asyncio.sleep(0.01)
        waits["c"] = asyncio.ensure_future(replica._ended("c"))
        scheduler.live.discard("a")
        await asyncio.wait_for(waits["a"], 1.0)
        assert not waits["b"].done() and not waits["c"].done()
        await asyncio.sleep(0.01)
        # one call at a time for all of them, not one each: "c", placed while the first was out, is in the next
        assert scheduler.asked[0] == ["a", "b"] and scheduler.asked[1:] == [["b", "c"]]
        scheduler.dead = True
        for r in ("b", "c"):
            with pytest.raises(RuntimeError, match="died"):
                await asyncio.wait_for(waits[r], 1.0)
        assert replica.running == {}

    asyncio.run(main())

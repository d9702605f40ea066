"""The consumer side without Ray: outputs fan out to their streams; a lost scheduler ends streams
with an error."""

import asyncio

from deploy.engine_client import EngineClient, complete, short_error
from scheduler.outputs import RequestOutput
from tests.factories import make_request
from tests.waiting import wait_for_async


class Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):  # like a Ray call: sent at once, awaited or not
        return asyncio.ensure_future(self.fn(*args, **kwargs))


class FakeScheduler:
    """Answers like the scheduler actor: each submitted request gets its tokens, then finishes.
    After `restart()` it is another instance that knows no earlier request."""

    def __init__(self, tokens_per_request=3):
        self.instance, self.pending, self.aborted = "A", [], []
        self.tokens = tokens_per_request
        self.submit = Call(self._submit)
        self.submit_many = Call(self._submit_many)
        self.poll = Call(self._poll)
        self.abort = Call(self._abort)

    async def _submit(self, request, consumer):
        self.pending += [RequestOutput(request.req_id, token_ids=[i]) for i in range(self.tokens)]
        self.pending.append(RequestOutput(request.req_id, finish_reason="length"))
        return self.instance

    # like the actor's: each entry submitted, or what refused it
    async def _submit_many(self, entries):
        answers = []
        for request, consumer in entries:
            try:
                answers.append(await self.submit.fn(request, consumer))
            except ValueError as e:
                answers.append(e)
        return answers

    async def _poll(self, consumer, timeout_s):
        await asyncio.sleep(0.001)  # one step: one output per request
        batch, seen = [], set()
        for out in self.pending:
            if out.req_id not in seen:
                seen.add(out.req_id)
                batch.append(out)
        self.pending = [out for out in self.pending if not any(out is b for b in batch)]
        return self.instance, batch

    async def _abort(self, req_id, instance=None):
        self.aborted.append(req_id)
        return True

    def restart(self):
        self.instance, self.pending = "B", []


def test_outputs_of_many_requests_reach_their_own_streams():
    client = EngineClient(FakeScheduler())

    async def scenario():
        return await asyncio.gather(*(complete(client, make_request(f"r{i}")) for i in range(5)))

    done = asyncio.run(scenario())
    assert [c.token_ids for c in done] == [[0, 1, 2]] * 5 and {c.finish_reason for c in done} == {
        "length"
    }


def test_a_restarted_scheduler_ends_the_streams_it_lost_with_an_error():
    scheduler = FakeScheduler()
    client = EngineClient(scheduler)

    async def scenario():
        original = scheduler._submit

        async def submit_then_restart(request, consumer):
            instance = await original(request, consumer)
            scheduler.restart()  # the replica dies before any output reached the client
            return instance

        scheduler.submit = Call(submit_then_restart)
        return await asyncio.wait_for(complete(client, make_request("lost")), timeout=5)

    done = asyncio.run(scenario())
    assert done.finish_reason == "error" and "restarted" in done.error and done.token_ids == []


def test_closing_a_stream_early_aborts_its_request():
    scheduler = FakeScheduler(tokens_per_request=50)
    client = EngineClient(scheduler)

    async def scenario():
        stream = client.generate(make_request("x"))
        await stream.__anext__()
        await stream.aclose()
        await wait_for_async(lambda: scheduler.aborted, 5)  # the abort was sent, not awaited

    asyncio.run(scenario())
    assert scheduler.aborted == ["x"]


def test_a_slow_reader_gets_waiting_outputs_merged_with_nothing_lost():
    client = EngineClient(FakeScheduler(tokens_per_request=20))

    async def scenario():
        chunks = []
        async for out in client.generate(make_request("slow")):
            chunks.append(out)
            await asyncio.sleep(0.01)  # slower than the scheduler answers
        return chunks

    chunks = asyncio.run(scenario())
    assert [t for c in chunks for t in c.token_ids] == list(range(20)) and chunks[
        -1
    ].finish_reason == "length"
    assert len(chunks) < 21 and [c.finished for c in chunks].count(True) == 1


class FakeCell(FakeScheduler):
    """A cell's scheduler: request i's tokens are 100*i.. (a continuation gets the rest after its
    outputs); `die()` makes every later call fail as a dead actor's would."""

    def __init__(self, name, tokens_per_request=6):
        super().__init__(tokens_per_request)
        self.instance, self.dead, self.taken = name, False, []

    async def _submit(self, request, consumer):
        self._check()
        self.taken.append(request)
        done = len(request.output_ids)
        self.pending += [
            RequestOutput(request.req_id, token_ids=[i], text=f"<{i}>")
            for i in range(done, self.tokens)
        ]
        self.pending.append(RequestOutput(request.req_id, finish_reason="length"))
        return self.instance

    async def _poll(self, consumer, timeout_s):
        self._check()
        return await super()._poll(consumer, timeout_s)

    def _check(self):
        if self.dead:
            raise RuntimeError("the actor died")

    def die(self):
        self.dead = True


class FakeCells:
    """Places each request on the first live cell (ServeCells would choose among the running
    ones)."""

    def __init__(self, cells, failover_timeout_s=2.0):
        self.cells, self.failover_timeout_s = cells, failover_timeout_s

    async def place(self, request, consumer, failing_over=False):
        from deploy.engine_client import Placement

        for cell in self.cells:
            if not cell.dead:
                return Placement(await cell.submit.remote(request, consumer), cell)
        raise RuntimeError("no live cell")

    def lost(self, placement):
        pass

    def done(self, req_id):
        pass


def test_a_stream_whose_cell_dies_continues_on_another_with_nothing_missing_or_repeated():
    a, b = FakeCell("A"), FakeCell("B")
    client = EngineClient(FakeCells([a, b]))

    async def scenario():
        stream = client.generate(make_request("x"))
        # tokens 0 and 1 reached the client
        got = [await stream.__anext__(), await stream.__anext__()]
        a.die()
        async for out in stream:
            got.append(out)
        return got

    got = asyncio.run(scenario())
    assert [t for o in got for t in o.token_ids] == list(range(6)) and got[
        -1
    ].finish_reason == "length"
    assert "".join(o.text for o in got) == "".join(f"<{i}>" for i in range(6))
    (moved,) = b.taken  # the continuation: same request, with what the client had
    assert moved.req_id == "x" and moved.output_ids == [0, 1] and moved.text_sent == len("<0><1>")
    assert client.num_failovers == 1


def test_an_unavailable_cell_sends_its_streams_to_another():
    """A cell that cannot serve a request (its workers are gone) answers `unavailable`: it moves
    on."""
    a, b = FakeCell("A"), FakeCell("B")
    original = a._submit

    async def no_workers(request, consumer):
        instance = await original(request, consumer)
        a.pending = [
            RequestOutput(
                request.req_id,
                finish_reason="error",
                error="no live decode worker",
                unavailable=True,
            )
        ]
        return instance

    a.submit = Call(no_workers)
    cells = FakeCells([a, b])
    client = EngineClient(cells)

    async def scenario():
        done = asyncio.ensure_future(complete(client, make_request("x")))
        await wait_for_async(lambda: a.taken, 5)  # placed on the cell that cannot serve it
        cells.cells = [b]  # Serve's router stops choosing the unhealthy cell
        return await asyncio.wait_for(done, 5)

    done = asyncio.run(scenario())
    assert (
        done.token_ids == list(range(6)) and done.finish_reason == "length" and done.error is None
    )


def test_a_stream_no_cell_can_take_ends_with_a_retryable_error_not_a_cut():
    a = FakeCell("A")
    client = EngineClient(FakeCells([a], failover_timeout_s=0.3))

    async def scenario():
        stream = client.generate(make_request("x"))
        got = [await stream.__anext__()]
        a.die()
        async for out in stream:
            got.append(out)
        return got

    got = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert got[0].token_ids == [0] and got[-1].finish_reason == "error" and got[-1].unavailable
    assert "no other could continue it" in got[-1].error


def test_an_abort_the_client_did_not_ask_for_moves_the_stream_instead_of_ending_it():
    """A cell that aborts a request on its own (a placement attempt cancelled there, a replica being
    stopped) must not end the client's stream with an empty `abort`: the stream continues on another
    cell. An abort the client asked for still ends it."""
    a, b = FakeCell("A"), FakeCell("B")
    original = a._submit

    async def aborts_after_two(request, consumer):
        instance = await original(request, consumer)
        a.pending = a.pending[:2] + [RequestOutput(request.req_id, finish_reason="abort")]
        a.submit = Call(original)  # once
        return instance

    a.submit = Call(aborts_after_two)
    client = EngineClient(FakeCells([a, b]))
    done = asyncio.run(asyncio.wait_for(complete(client, make_request("x")), 5))
    assert (
        done.token_ids == list(range(6)) and done.finish_reason == "length" and done.error is None
    )
    assert [r.output_ids for r in a.taken] == [[], [0, 1]] and client.num_failovers == 1

    slow = FakeCell("C", tokens_per_request=200)
    client = EngineClient(FakeCells([slow]))
    original_slow = slow._abort

    async def abort_publishes(req_id, instance=None):  # as the scheduler: a final `abort` output
        slow.pending = [RequestOutput(req_id, finish_reason="abort")]
        return await original_slow(req_id)

    slow.abort = Call(abort_publishes)

    async def asked():
        stream = client.generate(make_request("y"))
        got = [await stream.__anext__()]
        assert await client.abort("y")
        async for out in stream:
            got.append(out)
        return got

    got = asyncio.run(asyncio.wait_for(asked(), 5))
    assert got[-1].finish_reason == "abort" and client.num_failovers == 0


def test_a_client_reads_an_internal_error_short():
    """Ray's errors name hosts, process ids and tracebacks: the client gets their type only."""
    from ray.exceptions import RaySystemError

    assert short_error(RaySystemError("node 10.0.0.7 pid=4242\nTraceback ...")) == "RaySystemError"
    assert short_error(ValueError("no cell is running\n  File x.py")) == (
        "ValueError: no cell is running"
    )

"""The consumer side of the scheduler: one poll loop per cell fans outputs out to streams; lost
cells fail over.

Requests reach a scheduler through `Cells`: `OneScheduler` wraps one scheduler actor (the batch
driver, the benchmark); `ServeCells` (deploy/serving/cells.py) chooses a running cell of the Serve
deployment and submits to its scheduler, and when a cell dies its streams continue on another one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray.exceptions import ActorUnavailableError

from deploy.background import background
from deploy.submissions import Submissions
from scheduler.outputs import Completion, RequestOutput
from scheduler.request import Request, TokenLogprob, continuation

log = logging.getLogger(__name__)


@dataclass
class Placement:
    """Where a request runs: its cell (the id of the scheduler instance that took it) and the
    scheduler actor to poll and abort there."""

    cell: str
    scheduler: Any
    replica: str | None = None  # the Serve replica that holds the cell


class Cells(Protocol):
    failover_timeout_s: float | None  # None: a request whose cell is lost ends with an error

    async def place(
        self, request: Request, consumer: str, failing_over: bool = False
    ) -> Placement: ...

    def lost(self, placement: Placement) -> None:
        """That placement's cell is gone: place nothing there."""

    def done(self, req_id: str) -> None:
        """The request's stream has ended (its placement no longer counts as load)."""


class OneScheduler:
    """One scheduler actor (a restarted actor is another instance, so another cell)."""

    failover_timeout_s: float | None = None

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.submissions = Submissions(handle)  # the requests of a burst go in one call

    async def place(self, request: Request, consumer: str, failing_over: bool = False) -> Placement:
        return Placement(await self.submissions.submit(request, consumer), self.handle)

    def lost(self, placement: Placement) -> None:
        pass

    def done(self, req_id: str) -> None:
        pass


@dataclass(eq=False)
class _Stream:
    request: Request
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    cell: str | None = None
    moving: bool = False  # its cell was lost: it is being placed again
    # came while it was being placed
    early: list[tuple[str, RequestOutput]] = field(default_factory=list)
    # when it was first lost since its last token (failover gives up after a timeout)
    lost_s: float | None = None
    aborted: bool = False  # the client asked to abort it (`EngineClient.abort`)
    # what the client received so far: what a continuation starts from
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_len: int = 0

    def receive(self, out: RequestOutput) -> None:
        if out.token_ids:
            self.lost_s = None
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.text_len += len(out.text)
        self.queue.put_nowait(out)


class EngineClient:
    """Streams requests through schedulers under one consumer id.

    `generate(request)` yields the request's outputs as they come. One background task per cell
    polls its scheduler for every output of this client's requests there at once (one message per
    step, not one per token); it runs while any stream is open there. A stream read more slowly than
    steps come gets the outputs that waited for it merged into one. Closing a stream before its last
    output (a client that disconnected) aborts the request.

    A cell is lost when its scheduler dies (or restarts: polls answer from another instance); with
    failover, it is lost for one stream when it ends it unasked (`unavailable`, or an abort the
    client did not ask for: a placement attempt cancelled there, a replica being stopped). With
    `cells.failover_timeout_s` set, each of its streams is placed again as a continuation (prompt
    and the tokens this client received, same seed), so the stream goes on with no token missing or
    repeated; if no cell takes it within the timeout, it ends with an `unavailable` error. Without
    it, the streams end with an error at once.
    """

    def __init__(self, cells: Any, poll_timeout_s: float = 1.0) -> None:
        self.cells: Cells = cells if hasattr(cells, "place") else OneScheduler(cells)
        self.poll_timeout_s = poll_timeout_s
        self.consumer = f"consumer-{uuid.uuid4().hex[:12]}"
        self.streams: dict[str, _Stream] = {}
        self.placements: dict[str, Placement] = {}  # cell -> where it is (its scheduler handle)
        self.pollers: dict[str, asyncio.Task[None]] = {}
        self.num_polls = 0  # messages received from schedulers
        self.num_failovers = 0  # streams placed again after their cell was lost
        self._loop: asyncio.AbstractEventLoop | None = None

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit and stream. Raises what admission raises (ValueError, QueueFullError) before any
        output."""
        self._bind_loop()
        if request.req_id in self.streams:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        stream = self.streams[request.req_id] = _Stream(request)
        finished = False
        try:
            await self._place(stream, request)
            while True:
                out = await stream.queue.get()
                # a slow reader gets what waits as one
                while not out.finished and not stream.queue.empty():
                    out = out.then(stream.queue.get_nowait())
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self.streams.pop(request.req_id, None)
            self.cells.done(request.req_id)
            # the caller went away: free its slot and KV now
            if not finished and stream.cell is not None:
                self.placements[stream.cell].scheduler.abort.remote(request.req_id)

    def _bind_loop(self) -> None:
        """Used from another event loop than before (one `asyncio.run` per batch): the old loop's
        pollers are gone, and a poll they left on a scheduler may still take outputs, so start
        afresh under a new consumer id."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            self.consumer = f"consumer-{uuid.uuid4().hex[:12]}"
            self.streams = {}
            self.pollers = {}
        self._loop = loop

    async def abort(self, req_id: str) -> bool:
        stream = self.streams.get(req_id)
        if stream is None or stream.cell is None:
            return False
        stream.aborted = True
        return await self.placements[stream.cell].scheduler.abort.remote(req_id)

    def end_all(self, error: str, error_code: str) -> int:
        """End every open stream now with an error (a draining ingress at its timeout), aborting
        its request where it runs; returns how many were open."""
        streams = list(self.streams.values())
        for stream in streams:
            stream.aborted = True  # (the cell's abort output is not a loss to fail over from)
            if stream.cell is not None:
                self.placements[stream.cell].scheduler.abort.remote(stream.request.req_id)
            stream.cell = None
            stream.moving = False
            stream.queue.put_nowait(
                RequestOutput(
                    stream.request.req_id,
                    finish_reason="error",
                    error=error,
                    error_code=error_code,
                )
            )
        return len(streams)

    async def _place(self, stream: _Stream, request: Request, failing_over: bool = False) -> None:
        stream.cell = None
        stream.early = []
        placed = await self.cells.place(request, self.consumer, failing_over)
        if self.streams.get(request.req_id) is not stream:  # the caller went away meanwhile
            placed.scheduler.abort.remote(request.req_id)
            return
        stream.cell = placed.cell
        stream.moving = False
        # outputs its cell sent before the placement's answer came back
        for cell, out in stream.early:
            if cell == placed.cell:
                self._deliver(cell, stream, out)
        stream.early = []
        self.placements[placed.cell] = placed
        poller = self.pollers.get(placed.cell)
        if poller is None or poller.done():
            self.pollers[placed.cell] = background(self._poll(placed.cell))

    async def _poll(self, cell: str) -> None:
        scheduler = self.placements[cell].scheduler
        while any(s.cell == cell for s in self.streams.values()):
            try:
                instance, outputs = await scheduler.poll.remote(self.consumer, self.poll_timeout_s)
                self.num_polls += 1
            except ActorUnavailableError:  # a transient network error: the actor may still be there
                await asyncio.sleep(0.2)
                continue
            except Exception as e:  # the scheduler is gone
                log.error("polling cell %s failed: %s", cell, e)
                self._lost(cell, short_error(e))
                return
            if instance != cell:
                self._lost(cell, "the scheduler restarted and lost this request")
                return
            for out in outputs:
                stream = self.streams.get(out.req_id)
                if stream is None:
                    continue
                if stream.cell is None:  # being placed (where, its placement has not said yet)
                    stream.early.append((cell, out))
                # (outputs of a cell it left are dropped)
                elif stream.cell == cell and not stream.moving:
                    self._deliver(cell, stream, out)

    def _deliver(self, cell: str, stream: _Stream, out: RequestOutput) -> None:
        # with failover: a cell that cannot serve it, or gave it up unasked (a placement attempt
        # cancelled there, a replica stopping), loses the stream to another cell
        if self.cells.failover_timeout_s is not None and (
            out.unavailable or out.finish_reason == "abort" and not stream.aborted
        ):
            self._lost(
                cell,
                out.error or ("unavailable" if out.unavailable else "its cell aborted it"),
                [stream],
            )
        else:
            stream.receive(out)

    def _lost(self, cell: str, error: str, streams: list[_Stream] | None = None) -> None:
        """A cell is gone (for these streams, or all of its own): continue them elsewhere, or end
        them."""
        self.cells.lost(self.placements[cell])
        for stream in streams if streams is not None else list(self.streams.values()):
            if (
                stream.cell != cell
                or stream.moving
                or self.streams.get(stream.request.req_id) is not stream
            ):
                continue
            if self.cells.failover_timeout_s is None:
                stream.cell = None
                stream.queue.put_nowait(
                    RequestOutput(stream.request.req_id, finish_reason="error", error=error)
                )
                continue
            stream.moving = True
            stream.lost_s = stream.lost_s or time.monotonic()
            # in case it is still there (on that instance only: a restarted scheduler, reached
            # through the same handle, may be running its continuation by then)
            self.placements[cell].scheduler.abort.remote(stream.request.req_id, instance=cell)
            background(self._fail_over(stream, error))

    async def _fail_over(self, stream: _Stream, error: str) -> None:
        """Place a lost stream's continuation on a live cell (`cells.place` waits for one up to its
        timeout). A stream lost again before its next token waits a little longer each time, and
        gives up once the timeout has passed since it was first lost."""
        req_id = stream.request.req_id
        timeout = self.cells.failover_timeout_s or 0.0
        log.warning(
            "cell of %s lost (%s): continuing it after %d tokens",
            req_id,
            error,
            len(stream.token_ids),
        )
        waited = time.monotonic() - (stream.lost_s or time.monotonic())
        if waited < timeout:
            await asyncio.sleep(min(1.0, waited / 4))
            try:
                await self._place(
                    stream,
                    continuation(
                        stream.request, stream.token_ids, stream.logprobs, stream.text_len
                    ),
                    failing_over=True,
                )
                self.num_failovers += 1
                return
            except Exception as e:
                log.warning("continuing %s failed: %s", req_id, e)
                error = short_error(e)
        if self.streams.get(req_id) is stream:
            stream.cell = None
            stream.moving = False
            stream.queue.put_nowait(
                RequestOutput(
                    req_id,
                    finish_reason="error",
                    unavailable=True,
                    error=f"its cell was lost and no other could continue it: {error}",
                )
            )


def unwrap(exc: BaseException) -> BaseException:
    """What the engine raised, under Ray's and Serve's wrappers (each keeps the exception it wraps
    as `cause`)."""
    cause = getattr(exc, "cause", None)
    while isinstance(cause, BaseException) and cause is not exc:
        exc = cause
        cause = getattr(exc, "cause", None)
    return exc


def short_error(exc: BaseException) -> str:
    """What a client may read of an internal exception: its type, and the first line of its
    message unless Ray wrote it (Ray's name hosts, process ids and tracebacks; logged instead)."""
    exc = unwrap(exc)
    if type(exc).__module__.startswith("ray."):
        return type(exc).__name__
    first = (str(exc).splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


async def complete(client: EngineClient, request: Request) -> Completion:
    """Stream one request to its end and gather it into a Completion (with each token's arrival
    time)."""
    done = Completion(request.req_id, len(request.prompt_ids))
    async for out in client.generate(request):
        done.token_times_s += [time.perf_counter()] * len(out.token_ids)
        done.token_ids += out.token_ids
        done.logprobs += out.logprobs
        done.text += out.text
        if out.prompt_logprobs is not None:
            done.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            done.finish_reason = out.finish_reason
            done.error = out.error
            done.metrics = out.metrics
    return done

"""The consumer side of the scheduler actor: one poll loop per client fans outputs out to each stream.

Works over a plain actor handle (the batch driver, the benchmark) and over a Serve deployment handle
(each ingress replica): both answer `submit`, `poll` and `abort`, and their calls are awaitable.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from scheduler.outputs import Completion, RequestOutput
from scheduler.request import Request

log = logging.getLogger(__name__)


class EngineClient:
    """Streams requests through a scheduler handle under one consumer id.

    `generate(request)` yields the request's outputs as they come. One background task polls the
    scheduler for every output of this client's requests at once (one message per step, not one per
    token); it runs while any stream is open. A stream read more slowly than steps come gets the outputs
    that waited for it merged into one (fewer, larger SSE events when the HTTP edge is the bottleneck).
    Closing a stream before its last output (a client that
    disconnected) aborts the request. If the scheduler that took a request is gone (its actor or Serve
    replica restarted: polls answer from another instance), the request's stream ends with an error
    instead of waiting forever.
    """

    def __init__(self, handle: Any, poll_timeout_s: float = 1.0) -> None:
        self.handle, self.poll_timeout_s = handle, poll_timeout_s
        self.consumer = f"consumer-{uuid.uuid4().hex[:12]}"
        self.streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.instances: dict[str, str] = {}  # req_id -> the scheduler instance that took it
        self._poller: asyncio.Task[None] | None = None
        self.num_polls = 0  # messages received from the scheduler

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit and stream. Raises what admission raises (ValueError, QueueFullError) before any output."""
        if request.req_id in self.streams:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.streams[request.req_id] = queue
        finished = False
        try:
            self.instances[request.req_id] = await self.handle.submit.remote(request, self.consumer)
            self._ensure_polling()
            while True:
                out = await queue.get()
                while not out.finished and not queue.empty():  # a slow reader gets what waits as one output
                    out = _merge(out, queue.get_nowait())
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self.streams.pop(request.req_id, None)
            self.instances.pop(request.req_id, None)
            if not finished:  # the caller went away (or submit failed): free its slot and KV now
                self.handle.abort.remote(request.req_id)

    async def abort(self, req_id: str) -> bool:
        return await self.handle.abort.remote(req_id)

    def _ensure_polling(self) -> None:
        loop = asyncio.get_running_loop()
        if self._poller is None or self._poller.done() or self._poller.get_loop() is not loop:
            self._poller = loop.create_task(self._poll())

    async def _poll(self) -> None:
        while self.streams:
            try:
                instance, outputs = await self.handle.poll.remote(self.consumer, self.poll_timeout_s)
                self.num_polls += 1
            except Exception as e:  # the scheduler is gone: end every open stream with the error
                log.error("polling the scheduler failed: %s", e)
                self._end_streams(list(self.streams), f"the scheduler failed: {type(e).__name__}: {e}")
                return
            lost = [r for r in self.streams if self.instances.get(r, instance) != instance]
            self._end_streams(lost, "the scheduler restarted and lost this request")
            for out in outputs:
                queue = self.streams.get(out.req_id)
                if queue is not None:
                    queue.put_nowait(out)


    def _end_streams(self, req_ids: list[str], error: str) -> None:
        """End these streams with an error output (their requests are gone with their scheduler)."""
        for req_id in req_ids:
            self.instances.pop(req_id, None)
            self.streams[req_id].put_nowait(RequestOutput(req_id, finish_reason="error", error=error))


def _merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two successive outputs of one request as one: tokens and text joined, the later one's ending."""
    return RequestOutput(first.req_id, first.token_ids + then.token_ids, first.text + then.text,
                         then.finish_reason, then.error, then.metrics or first.metrics, first.logprobs + then.logprobs,
                         first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs)


async def complete(client: EngineClient, request: Request) -> Completion:
    """Stream one request to its end and gather it into a Completion (with each token's arrival time)."""
    done = Completion(request.req_id, len(request.prompt_ids))
    async for out in client.generate(request):
        done.token_times_s += [time.perf_counter()] * len(out.token_ids)
        done.token_ids += out.token_ids
        done.logprobs += out.logprobs
        done.text += out.text
        if out.prompt_logprobs is not None:
            done.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            done.finish_reason, done.error, done.metrics = out.finish_reason, out.error, out.metrics
    return done

"""Requests on their way to one scheduler actor, sent together: one `submit_many` call at a time.

The requests queued while a submission is on its way go together in the next one, and each is
refused or queued on its own, so a burst of N requests costs a couple of calls, not N. The driver's
`OneScheduler` and each ingress replica (one per cell: `ServeCells`) send through one of these.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from deploy.background import background
from scheduler.request import Request


@dataclass(eq=False)
class _Entry:
    request: Request
    consumer: str
    answer: asyncio.Future[str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Submissions:
    """`await submit(request, consumer)` answers with the scheduler's instance id, or raises what
    refused the request (ValueError, QueueFullError included) or what the call to the scheduler
    raised (it is gone).

    A caller that gives up (is cancelled) before its request left takes it out of the queue: it is
    never sent. One that gives up while its request is on its way has it aborted as soon as the
    answer says it was queued (calls from here to the actor run in order, so the abort follows
    it)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.queued: list[_Entry] = []
        self.sender: asyncio.Task[None] | None = None

    async def submit(self, request: Request, consumer: str) -> str:
        entry = _Entry(request, consumer)
        self.queued.append(entry)
        if (
            self.sender is None
            or self.sender.done()
            or self.sender.get_loop() is not asyncio.get_running_loop()
        ):
            self.sender = background(self._send())
        try:
            return await entry.answer
        except asyncio.CancelledError:
            # (if it was still there: never sent)
            self.queued = [e for e in self.queued if e is not entry]
            raise

    async def _send(self) -> None:
        while self.queued:
            batch, self.queued = self.queued, []
            try:
                answers = await self.scheduler.submit_many.remote(
                    [(e.request, e.consumer) for e in batch]
                )
            except Exception as e:  # the scheduler is gone: each caller raises it
                answers = [e] * len(batch)
            for entry, answer in zip(batch, answers, strict=True):
                if entry.answer.done():  # its caller went away while it was on its way
                    if not isinstance(answer, BaseException):
                        self.scheduler.abort.remote(entry.request.req_id)
                elif isinstance(answer, BaseException):
                    entry.answer.set_exception(answer)
                else:
                    entry.answer.set_result(answer)

"""Consumers' mailboxes: the outputs each consumer's next poll takes, and who stopped polling."""

from __future__ import annotations

import asyncio
import time

from scheduler.outputs import RequestOutput, coalesce


class Mailboxes:
    """One mailbox per consumer (the batch driver, each ingress replica): outputs wait there for
    its next poll, each request's successive outputs joined into one when taken."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[RequestOutput]] = {}  # consumer -> outputs not yet polled
        self.mail: dict[str, asyncio.Event] = {}
        self.last_poll_s: dict[str, float] = {}

    def seen(self, consumer: str) -> None:
        """A consumer submitted: its polling clock starts now if it never polled."""
        self.last_poll_s.setdefault(consumer, time.monotonic())

    def put(self, consumer: str, outputs: list[RequestOutput]) -> None:
        self.outputs.setdefault(consumer, []).extend(outputs)
        self.mail.setdefault(consumer, asyncio.Event()).set()

    async def take(self, consumer: str, timeout_s: float) -> list[RequestOutput]:
        """Every output waiting for the consumer; waits up to `timeout_s` for one."""
        self.last_poll_s[consumer] = time.monotonic()
        event = self.mail.setdefault(consumer, asyncio.Event())
        if not self.outputs.get(consumer):
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except TimeoutError:
                pass
        self.last_poll_s[consumer] = time.monotonic()
        return coalesce(self.outputs.pop(consumer, []))

    def take_silent(self, timeout_s: float) -> list[str]:
        """The consumers that have not polled for `timeout_s`, forgotten with their mail."""
        now = time.monotonic()
        silent = [c for c, last in self.last_poll_s.items() if now - last > timeout_s]
        for consumer in silent:
            del self.last_poll_s[consumer]
            self.outputs.pop(consumer, None)
            self.mail.pop(consumer, None)
        return silent

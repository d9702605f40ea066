"""Releasing work at arrival offsets: the one mechanism behind every driver that replays a trace."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ArrivalSchedule(Generic[T]):
    """Items released `offset` seconds after `start()`, in offset order (ties keep their given order).

    `due()` returns what has arrived since the last call; `wait_s()` says how long until the next
    arrival. The local engine polls it between steps; the Ray and HTTP drivers sleep on it.
    """

    def __init__(self, items: Iterable[T], offsets: Callable[[T], float] = lambda item: 0.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        order = itertools.count()
        self.pending = sorted(((offsets(item), next(order), item) for item in items), key=lambda e: e[:2])
        self.clock = clock
        self.t0 = clock()

    def start(self) -> None:
        self.t0 = self.clock()

    def due(self) -> list[T]:
        now = self.clock() - self.t0
        count = next((i for i, entry in enumerate(self.pending) if entry[0] > now), len(self.pending))
        released, self.pending = self.pending[:count], self.pending[count:]
        return [item for _, _, item in released]

    def wait_s(self) -> float:
        """Seconds until the next arrival (0 if one is due, or none is left)."""
        if not self.pending:
            return 0.0
        return max(0.0, self.pending[0][0] - (self.clock() - self.t0))

    def __bool__(self) -> bool:
        return bool(self.pending)


async def run_at_arrivals(schedule: ArrivalSchedule[T], start: Callable[[T], Awaitable[Any]]) -> list[Any]:
    """Start `start(item)` for each item as it arrives, concurrently; the results in arrival order."""
    tasks: list[asyncio.Task[Any]] = []
    schedule.start()
    while True:
        tasks += [asyncio.create_task(start(item)) for item in schedule.due()]
        if not schedule:
            break
        await asyncio.sleep(schedule.wait_s())
    return list(await asyncio.gather(*tasks))

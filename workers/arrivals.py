"""Releasing work at arrival offsets, or when the work it follows ends: the one mechanism behind
every driver."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ArrivalSchedule(Generic[T]):
    """Items released `offset` seconds after `start()`, in offset order (ties keep their given
    order).

    `due()` returns what has arrived since the last call; `wait_s()` says how long until the next
    arrival. The local engine polls it between steps; the Ray and HTTP drivers sleep on it.

    Chains (`after`: the key of the item an item follows, or None): an item that follows another is
    released when the driver reports that one `ended`, not at its offset: a closed loop, such as a
    steady population of streams each replaced as it ends. Chains are background load: while items
    outside every chain (the foreground) are still to come or running, a chain goes on; once the
    last of them has ended, what remains of every chain is dropped (never released). Without
    foreground items, chains run to their ends. An item whose predecessor is not in the schedule is
    an ordinary one.
    """

    def __init__(
        self,
        items: Iterable[T],
        offsets: Callable[[T], float] = lambda item: 0.0,
        clock: Callable[[], float] = time.perf_counter,
        key: Callable[[T], Hashable] = id,
        after: Callable[[T], Hashable | None] = lambda item: None,
    ) -> None:
        items = list(items)
        keys = {key(item) for item in items}
        order = itertools.count()
        self.clock = clock
        self.key = key
        # predecessor's key -> the items released when it ends
        self.held: dict[Hashable, list[T]] = {}
        chained: set[Hashable] = set()
        timed = []
        for item in items:
            before = after(item)
            if before is not None and before in keys:
                self.held.setdefault(before, []).append(item)
                chained |= {before, key(item)}
            else:
                timed.append((offsets(item), next(order), item))
        self.pending = sorted(timed, key=lambda e: e[:2])
        self.foreground = {key(item) for item in items} - chained  # not yet ended
        self.has_foreground = bool(self.foreground)
        self.dropped: list[T] = []
        self.t0 = clock()

    @classmethod
    def by_key(
        cls,
        items: Iterable[T],
        arrival_s: dict[Any, float] | None = None,
        after: dict[Any, Any] | None = None,
        key: Callable[[T], Hashable] = lambda item: item.req_id,
    ) -> ArrivalSchedule[T]:  # type: ignore[attr-defined]
        """Items named by `key` (a request's id by default): each arrives at `arrival_s[name]` (0 if
        absent), or when the item named `after[name]` ends."""
        arrival_s, after = arrival_s or {}, after or {}
        return cls(
            items,
            lambda item: arrival_s.get(key(item), 0.0),
            key=key,
            after=lambda item: after.get(key(item)),
        )

    def start(self) -> None:
        self.t0 = self.clock()

    def due(self) -> list[T]:
        now = self.clock() - self.t0
        count = next(
            (i for i, entry in enumerate(self.pending) if entry[0] > now), len(self.pending)
        )
        released, self.pending = self.pending[:count], self.pending[count:]
        return [item for _, _, item in released]

    def ended(self, key: Hashable) -> None:
        """The item of this key has ended: release what follows it (or drop it, once the foreground
        is done)."""
        self.foreground.discard(key)
        following = self.held.pop(key, [])
        if self.has_foreground and not self.foreground:
            self._drop(following + [item for items in self.held.values() for item in items])
            self.held = {}
            return
        now = self.clock() - self.t0
        self.pending = sorted(
            self.pending + [(now, -1, item) for item in following], key=lambda e: e[:2]
        )

    def _drop(self, items: list[T]) -> None:
        while items:
            item = items.pop()
            self.dropped.append(item)
            items += self.held.pop(self.key(item), [])

    def wait_s(self) -> float:
        """Seconds until the next arrival (0 if one is due or none is left; infinite while only
        items that wait for another to end are left)."""
        if not self.pending:
            return math.inf if self.held else 0.0
        return max(0.0, self.pending[0][0] - (self.clock() - self.t0))

    def __bool__(self) -> bool:
        return bool(self.pending or self.held)


async def run_at_arrivals(
    schedule: ArrivalSchedule[T], start: Callable[[T], Awaitable[Any]]
) -> list[Any]:
    """Start `start(item)` for each item as it arrives, concurrently (an item that follows another
    when that one's `start` returns); the results in the order the items started."""
    tasks: list[asyncio.Task[Any]] = []
    woken = asyncio.Event()

    async def run(item: T) -> Any:
        try:
            return await start(item)
        finally:
            schedule.ended(schedule.key(item))
            woken.set()

    schedule.start()
    while True:
        tasks += [asyncio.create_task(run(item)) for item in schedule.due()]
        if not schedule:
            break
        woken.clear()
        wait = schedule.wait_s()
        try:
            await asyncio.wait_for(woken.wait(), None if math.isinf(wait) else wait)
        except TimeoutError:
            pass
    return list(await asyncio.gather(*tasks))

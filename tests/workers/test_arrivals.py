"""Arrival schedules: offsets, and chains that start when the item before them ends (a steady
population)."""

import asyncio
import math
import time

from workers.arrivals import ArrivalSchedule, run_at_arrivals


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_chain_goes_on_while_the_foreground_lasts_then_the_rest_is_dropped():
    # "a" -> "b" -> "c" is a chain (background load); "x" and "y" arrive at 1 s and 2 s (foreground)
    clock = Clock()
    follows = {"b": "a", "c": "b"}
    offsets = {"x": 1.0, "y": 2.0}
    schedule = ArrivalSchedule(
        ["a", "b", "c", "x", "y"],
        lambda item: offsets.get(item, 0.0),
        clock,
        key=str,
        after=follows.get,
    )
    schedule.start()
    assert schedule.due() == ["a"] and schedule.wait_s() == 1.0
    clock.now = 1.5
    assert schedule.due() == ["x"]
    schedule.ended("a")  # "b" follows at once, whatever its offset
    assert schedule.due() == ["b"] and schedule.wait_s() == 0.5
    clock.now = 2.0
    # "c" waits for "b"
    assert schedule.due() == ["y"] and schedule.wait_s() == math.inf and schedule
    schedule.ended("x")
    schedule.ended("y")  # the foreground is done: "c" will never start
    assert not schedule and schedule.dropped == ["c"] and schedule.wait_s() == 0.0
    schedule.ended("b")
    assert schedule.due() == []


def test_chains_alone_run_to_their_end_and_an_unknown_predecessor_is_no_chain():
    clock = Clock()
    follows = {"b": "a", "z": "gone"}
    schedule = ArrivalSchedule(
        ["a", "b", "z"], lambda item: 3.0 if item == "z" else 0.0, clock, key=str, after=follows.get
    )
    assert schedule.due() == ["a"]
    clock.now = 5.0
    schedule.ended("a")
    assert schedule.due() == ["z", "b"] and not schedule  # in offset order: "b" arrived at 5 s


def test_run_at_arrivals_starts_a_follower_when_its_predecessor_returns():
    started: dict[str, float] = {}
    ended: dict[str, float] = {}

    async def start(item: str) -> str:
        started[item] = time.perf_counter()
        await asyncio.sleep(0.05 if item in "ab" else 0.2)
        ended[item] = time.perf_counter()
        return item

    follows = {"b": "a", "c": "b", "d": "c"}
    schedule = ArrivalSchedule(
        ["a", "b", "c", "d", "x"], lambda item: 0.0, key=str, after=follows.get
    )
    assert asyncio.run(run_at_arrivals(schedule, start)) == ["a", "x", "b", "c"]
    assert started["b"] >= ended["a"] and started["c"] >= ended["b"]
    assert "d" not in started  # "x" (the foreground) ended while "c" ran


def test_a_schedule_by_key_takes_offsets_and_chains_by_name_and_defaults_to_now():
    clock = Clock()

    class Item:
        def __init__(self, req_id: str) -> None:
            self.req_id = req_id

    items = [Item(name) for name in ("a", "b", "late")]
    schedule = ArrivalSchedule.by_key(items, {"late": 3.0}, {"b": "a"})
    schedule.clock = clock
    schedule.start()
    # "b" follows "a"
    assert [i.req_id for i in schedule.due()] == ["a"] and schedule.wait_s() == 3.0
    schedule.ended("a")
    assert [i.req_id for i in schedule.due()] == ["b"]
    clock.now = 3.0
    assert [i.req_id for i in schedule.due()] == ["late"]

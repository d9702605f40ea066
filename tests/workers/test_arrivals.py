"""Arrival schedules: offsets, and chains that start when the item before them ends (a steady
population)."""

import asyncio
import math

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
    """The chain a -> b -> c -> d beside the foreground item x, which ends while c runs: d never
    starts. x ends once c has started, and c once x has ended: events, not durations, order
    them."""
    seen: list[str] = []

    async def scenario() -> list[str]:
        c_started, x_ended = asyncio.Event(), asyncio.Event()

        async def start(item: str) -> str:
            seen.append(f"start {item}")
            if item == "x":
                await c_started.wait()
            elif item == "c":
                c_started.set()
                await x_ended.wait()
            seen.append(f"end {item}")
            if item == "x":
                x_ended.set()
            return item

        follows = {"b": "a", "c": "b", "d": "c"}
        schedule = ArrivalSchedule(
            ["a", "b", "c", "d", "x"], lambda item: 0.0, key=str, after=follows.get
        )
        # (a chain that never reaches c fails here instead of hanging)
        return await asyncio.wait_for(run_at_arrivals(schedule, start), 10)

    assert asyncio.run(scenario()) == ["a", "x", "b", "c"]
    assert seen.index("start b") > seen.index("end a")
    assert seen.index("start c") > seen.index("end b")
    assert "start d" not in seen  # "x" (the foreground) ended while "c" ran


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

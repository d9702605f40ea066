"""Deadlines and the cell's vLLM-style counts, without Ray: requests past their queue deadline or
their own timeout end with an error that says which, and free everything they held; the counters
and histograms `/metrics` reads move by what the streams received."""

import pytest

from scheduler.cell.deadlines import QUEUE_TIMEOUT, TIMEOUT, expire
from scheduler.cell.serving_metrics import ServingMetrics
from scheduler.outputs import RequestOutput
from tests.scheduler.cell.cells import (
    Streams,
    assert_idle,
    cell,
    expected_tokens,
    req,
    step_all,
)


def outputs_of(coordinator):
    return [out for outs in coordinator.take_outputs().values() for out in outs]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_requests_still_waiting_past_the_queue_deadline_end_with_queue_timeout(mode):
    coordinator = cell(mode, decode_slots=1, prefill_slots=1)
    requests = [req(f"r{i}", max_tokens=5) for i in range(3)]
    for r in requests:
        r.max_queue_s = 1.0
        coordinator.admit(r, consumer="c")
    streams = Streams()
    step_all(coordinator, streams, steps=1)  # r0 has a slot; the others wait
    arrival = requests[0].arrival_s
    assert expire(coordinator, arrival + 0.5) == []  # before the deadline: nothing
    passed = expire(coordinator, arrival + 1.5)
    ended = {o.req_id: o for o in outputs_of(coordinator) if o.finished}
    assert sorted(ended) == ["r1", "r2"] and passed == [QUEUE_TIMEOUT] * 2
    assert all(o.error_code == QUEUE_TIMEOUT and "r" in o.error for o in ended.values())
    assert "past its deadline" in ended["r1"].error and not ended["r1"].unavailable
    # the one that had a slot runs to its end, and the cell is left with nothing
    step_all(coordinator, streams)
    assert streams.tokens["r0"] == expected_tokens("r0", 5)
    assert streams.finish == {"r0": "length"}
    assert_idle(coordinator)


def test_a_request_past_its_own_timeout_ends_with_timeout_while_others_go_on():
    coordinator = cell("colocated", decode_slots=2)
    slow = req("slow", max_tokens=20)
    slow.timeout_s = 5.0
    other = req("other", max_tokens=8)
    coordinator.admit(slow, consumer="c")
    coordinator.admit(other, consumer="c")
    streams = Streams()
    step_all(coordinator, streams, steps=3)
    assert expire(coordinator, slow.arrival_s + 5.5) == [TIMEOUT]
    streams.take(coordinator)
    assert streams.finish["slow"] == "error" and "slow ran" in streams.errors["slow"]
    assert len(streams.tokens["slow"]) < 20
    step_all(coordinator, streams)
    assert streams.tokens["other"] == expected_tokens("other", 8)
    assert_idle(coordinator)


def test_serving_metrics_count_tokens_latencies_and_reasons():
    book = ServingMetrics()
    book.on_admit(10, continuation=False)
    book.on_admit(10, continuation=True)  # placed again after its cell was lost
    book.on_output(RequestOutput("a", token_ids=[1]), now=1.0)
    book.on_output(RequestOutput("a", token_ids=[2, 3]), now=1.4)  # two tokens: 0.2 s each
    metrics = {"ttft_s": 0.05, "e2e_s": 1.5, "queue_s": 0.01, "prefill_s": 0.04, "decode_s": 1.4}
    book.on_output(RequestOutput("a", [4], finish_reason="length", metrics=metrics), now=1.5)
    book.on_output(RequestOutput("b", finish_reason="error", error="x", metrics=metrics), now=2.0)
    book.on_timeout(QUEUE_TIMEOUT)
    snap = book.snapshot()
    assert snap["counters"] == {
        "prompt_tokens": 10,
        "failovers": 1,
        "generation_tokens": 4,
        "kv_handoff_seconds": 0.0,
    }
    assert snap["finished"] == {"length": 1, "error": 1}
    assert snap["timeouts"] == {QUEUE_TIMEOUT: 1}
    itl = snap["histograms"]["inter_token_latency_seconds"]
    assert itl["count"] == 3 and itl["sum"] == pytest.approx(0.5)
    # only a request that ran to its end is in the latency histograms
    ttft = snap["histograms"]["time_to_first_token_seconds"]
    assert ttft["count"] == 1 and ttft["sum"] == pytest.approx(0.05)
    assert ttft["counts"][ttft["buckets"].index(0.06)] == 1  # in (0.04, 0.06]
    assert not book.last_token_s  # nothing kept of finished requests

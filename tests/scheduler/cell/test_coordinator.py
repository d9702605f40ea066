"""The scheduler's decisions without Ray or a model: routing, handoffs, loss, death, abort,
preemption. The cell's workers are fakes (`tests/scheduler/cell/cells.py`) that check every
stream is whole and every chunk finds its request's rows."""

import itertools

import pytest

from scheduler.cell.state import WorkerStatus
from scheduler.request import Request, RequestStatus
from scheduler.step_planner import QueueFullError
from tests.scheduler.cell.cells import (
    Streams,
    assert_idle,
    cell,
    expected_tokens,
    fake_step,
    record_steps,
    req,
    run_overlapped,
    step_all,
    token,
)


def test_disaggregated_requests_are_prefilled_handed_off_and_decoded():
    coordinator, streams = cell(), Streams()
    for i in range(4):
        coordinator.admit(req(f"r{i}", prompt_len=5 + i, max_tokens=6), consumer="c")
    step_all(coordinator, streams)
    assert streams.tokens == {f"r{i}": expected_tokens(f"r{i}", 6) for i in range(4)}
    assert set(streams.finish.values()) == {"length"}
    assert coordinator.counts.handoffs == 4 and coordinator.counts.handoff_bytes == 4000
    assert_idle(coordinator)
    handoffs = coordinator.metrics.handoff_seconds.observations
    assert len(handoffs) == 4 and all(seconds == pytest.approx(0.003) for seconds, _ in handoffs)


def test_final_outputs_carry_where_the_request_ran():
    coordinator = cell(num_prefill_workers=2, num_decode_workers=2)
    coordinator.admit(req("a"), consumer="c")
    coordinator.admit(req("b"), consumer="c")
    finals = []
    for _ in range(50):
        for worker in coordinator.workers:
            step = coordinator.next_step(worker)
            if step is not None:
                coordinator.apply(worker, step[0], fake_step(coordinator, worker, *step))
        finals += [o for outs in coordinator.take_outputs().values() for o in outs if o.finished]
    metrics = {o.req_id: o.metrics for o in finals}
    # least loaded
    assert {metrics["a"]["prefill_worker"], metrics["b"]["prefill_worker"]} == {0, 1}
    assert {metrics["a"]["decode_worker"], metrics["b"]["decode_worker"]} == {0, 1}
    assert all(
        m["kv_handoff_bytes"] == 1000 and m["kv_handoff_s"] == pytest.approx(0.003)
        for m in metrics.values()
    )


def test_short_prompts_skip_the_handoff_and_colocated_never_hands_off():
    coordinator, streams = cell(local_prefill_max_tokens=8), Streams()
    coordinator.admit(req("short", prompt_len=4), consumer="c")
    coordinator.admit(req("long", prompt_len=12), consumer="c")
    assert [r.req_id for r in coordinator.decode[0].step_planner.waiting_requests()] == ["short"]
    step_all(coordinator, streams)
    assert coordinator.counts.handoffs == 1 and streams.tokens["short"] == expected_tokens(
        "short", 5
    )
    colocated, streams = cell(mode="colocated", num_decode_workers=2), Streams()
    for i in range(3):
        colocated.admit(req(f"r{i}"), consumer="c")
    step_all(colocated, streams)
    assert colocated.prefill == [] and colocated.counts.handoffs == 0 and len(streams.finish) == 3


def test_outputs_go_to_the_consumer_that_submitted():
    coordinator = cell()
    coordinator.admit(req("a"), consumer="ingress-1")
    coordinator.admit(req("b"), consumer="ingress-2")
    seen: dict[str, set[str]] = {}
    for _ in range(60):
        for worker in coordinator.workers:
            step = coordinator.next_step(worker)
            if step is not None:
                coordinator.apply(worker, step[0], fake_step(coordinator, worker, *step))
        for consumer, outputs in coordinator.take_outputs().items():
            seen.setdefault(consumer, set()).update(o.req_id for o in outputs)
    assert seen == {"ingress-1": {"a"}, "ingress-2": {"b"}}


@pytest.mark.parametrize("when", ["early", "at the handoff"])
def test_a_lost_handoff_is_prefilled_again_and_continues_exactly(when):
    """KV pieces lost once: found at the first early import into the idle decode worker's reserved
    slot, or (its only slot busy) when every piece is imported at the handoff."""
    coordinator, streams, lose = (
        cell(decode_slots=1 if when == "at the handoff" else 2),
        Streams(),
        {"a"},
    )
    if when == "at the handoff":
        coordinator.admit(req("busy", prompt_len=3, max_tokens=12), consumer="c")
    coordinator.admit(req("a", max_tokens=8), consumer="c")

    def lost_once(worker, imports, result):
        if result.failed_imports:
            assert [i.final for i in imports] == [when == "at the handoff"]
            lose.clear()

    step_all(coordinator, streams, lose_imports=lose, observe=lost_once)
    assert coordinator.counts.recomputes == 1 and not lose
    assert streams.tokens["a"] == expected_tokens("a", 8) and streams.finish["a"] == "length"
    assert_idle(coordinator)


def test_a_request_that_keeps_losing_its_cache_ends_with_an_error_alone():
    coordinator, streams = cell(max_recomputes=1), Streams()
    coordinator.admit(req("doomed"), consumer="c")
    coordinator.admit(req("fine", prompt_len=9), consumer="c")
    step_all(coordinator, streams, lose_imports={"doomed"})
    assert streams.finish == {"doomed": "error", "fine": "length"}
    assert "giving up" in streams.errors["doomed"] and streams.tokens["fine"] == expected_tokens(
        "fine", 5
    )
    assert_idle(coordinator)


def test_with_the_fail_policy_a_lost_transfer_ends_its_request_with_an_error_alone():
    coordinator, streams = cell(kv_transfer_failure="fail"), Streams()
    coordinator.admit(req("lost"), consumer="c")
    coordinator.admit(req("fine", prompt_len=9), consumer="c")
    step_all(coordinator, streams, lose_imports={"lost"})
    assert streams.finish == {"lost": "error", "fine": "length"}
    assert "KV transfer of request lost failed" in streams.errors["lost"]
    assert coordinator.counts.recomputes == 0
    assert streams.tokens["fine"] == expected_tokens("fine", 5)
    assert_idle(coordinator)


def test_a_dead_decode_worker_loses_no_stream():
    coordinator, streams = cell(num_decode_workers=2, decode_slots=3), Streams()
    for i in range(5):
        coordinator.admit(req(f"r{i}", max_tokens=12), consumer="c")
    step_all(coordinator, streams, steps=8)
    victim = max(coordinator.decode, key=lambda w: len(w.step_planner.running))
    assert victim.step_planner.running
    coordinator.worker_died(victim)
    assert victim.status is WorkerStatus.RESTARTING and victim.slots_used == 0
    step_all(coordinator, streams)
    assert streams.tokens == {f"r{i}": expected_tokens(f"r{i}", 12) for i in range(5)}
    coordinator.worker_back(victim, {"pid": 1})
    assert victim.status is WorkerStatus.UP and coordinator.counts.worker_failures == 1
    assert_idle(coordinator)


def test_when_a_whole_pool_is_gone_waiting_requests_end_with_an_error():
    coordinator, streams = cell(), Streams()
    prefill = coordinator.prefill[0]
    coordinator.admit(req("a"), consumer="c")
    coordinator.worker_died(prefill)
    coordinator.admit(req("b"), consumer="c")  # queued on the restarting worker
    assert prefill.step_planner.num_waiting == 2
    coordinator.worker_gone(prefill)
    streams.take(coordinator)
    assert streams.finish == {"a": "error", "b": "error"} and "gone" in streams.errors["a"]
    assert coordinator.pool_exhausted()
    coordinator.admit(req("c"), consumer="c")  # nothing can take it: it ends at once, not hangs
    streams.take(coordinator)
    assert streams.finish["c"] == "error"


@pytest.mark.parametrize(
    "state", ["waiting", "prefilling", "pieces-sent", "handed-off", "decoding"]
)
def test_abort_in_every_state_frees_everything(state):
    coordinator, streams = cell(decode_slots=1, prefill_chunk=2, token_budget=2), Streams()
    # holds the decode slot once handed off
    coordinator.admit(req("hog", max_tokens=40), consumer="c")
    step_all(coordinator, streams, steps=4)
    coordinator.admit(req("x", prompt_len=6, max_tokens=5), consumer="c")
    # waits behind x for the prefill row
    coordinator.admit(req("y", prompt_len=6, max_tokens=5), consumer="c")
    reached = {
        "waiting": lambda: (
            "y" in {r.req_id for r in coordinator.prefill[0].step_planner.waiting_requests()}
        ),
        "prefilling": lambda: any(
            r.req_id == "x" for r in coordinator.prefill[0].step_planner.running
        ),
        # 2 of its 3 chunks' KV out
        "pieces-sent": lambda: len(coordinator.kv.pieces.get("x", ())) == 2,
        "handed-off": lambda: "x" in coordinator.kv.handoffs,
        "decoding": lambda: any(
            r.req_id == "x" for r in coordinator.decode[0].step_planner.running
        ),
    }
    target = "y" if state == "waiting" else "x"
    if state == "decoding":
        coordinator.abort("hog")
    for _ in itertools.count():
        if reached[state]():
            break
        step_all(coordinator, streams, steps=1)
    assert coordinator.abort(target) and not coordinator.abort(target)
    streams.take(coordinator)
    assert streams.finish[target] == "abort" and target not in coordinator.kv.handoffs
    # every piece's ref dropped at once: the store frees them
    assert target not in coordinator.kv.pieces
    for other in {"hog", "x", "y"} - {target} - set(streams.finish):
        coordinator.abort(other)
    streams.take(coordinator)
    assert_idle(coordinator)


def test_preemption_on_a_decode_worker_recomputes_on_the_prefill_pool():
    coordinator, streams = cell(decode_slots=1), Streams()
    normal = req("normal", max_tokens=20, priority=1)
    coordinator.admit(normal, consumer="c")
    step_all(coordinator, streams, steps=6)
    assert coordinator.decode[0].step_planner.running == [normal]
    coordinator.admit(req("urgent", max_tokens=4, priority=0), consumer="c")
    step_all(coordinator, streams)
    assert streams.tokens == {
        "normal": expected_tokens("normal", 20),
        "urgent": expected_tokens("urgent", 4),
    }
    # normal handed off twice
    assert normal.num_preemptions == 1 and coordinator.counts.handoffs == 3
    assert_idle(coordinator)


def test_admission_errors_leave_nothing_behind():
    coordinator = cell(max_waiting=1)
    coordinator.admit(req("a"), consumer="c")
    with pytest.raises(ValueError, match="already in use"):
        coordinator.admit(req("a"), consumer="c")
    with pytest.raises(ValueError, match="context limit of 64"):
        coordinator.admit(req("big", prompt_len=60, max_tokens=10), consumer="c")
    ran = req("ran")
    ran.status = RequestStatus.FINISHED  # (a Request object some engine already ran)
    with pytest.raises(ValueError, match="has already run"):
        coordinator.admit(ran, consumer="c")
    with pytest.raises(QueueFullError):
        coordinator.admit(req("b"), consumer="c")
    assert set(coordinator.consumers) == {"a"}


def test_a_consumer_that_went_away_has_its_requests_aborted():
    coordinator, streams = cell(), Streams()
    coordinator.admit(req("a", max_tokens=30), consumer="gone")
    coordinator.admit(req("b", max_tokens=30), consumer="gone")
    coordinator.admit(req("c", max_tokens=3), consumer="alive")
    step_all(coordinator, streams, steps=5)
    assert coordinator.abort_consumer("gone") == 2 and coordinator.counts.aborts == 2
    assert coordinator.abort_consumer("gone") == 0 and not coordinator.abort("a")
    step_all(coordinator, streams)
    assert streams.finish["c"] == "length" and "gone" not in coordinator.take_outputs()
    assert coordinator.stats()["counters"]["aborts"] == 2
    assert_idle(coordinator)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_one_step_in_flight_changes_no_output(mode):
    """Planning ahead never samples past max_tokens, and a token sampled for a request that already
    stopped (on a stop id, decided only when the step before is applied) never reaches its
    stream."""
    stop_at = {"s0": 2, "s1": 5}  # these requests sample their stop token at this output index
    coordinator, streams = cell(mode=mode, decode_slots=4, token_budget=16), Streams()
    requests = [req(f"r{i}", prompt_len=3 + 5 * i, max_tokens=1 + 3 * i) for i in range(4)]
    for name, index in stop_at.items():
        stop = frozenset({token(name, index)})
        requests.append(
            Request(req_id=name, prompt_ids=[1, 2, 3], max_tokens=20, stop_token_ids=stop)
        )
    for request in requests:
        coordinator.admit(request, consumer="c")
    run_overlapped(coordinator, streams)
    for request in requests:
        length = stop_at[request.req_id] + 1 if request.req_id in stop_at else request.max_tokens
        assert streams.tokens[request.req_id] == expected_tokens(request.req_id, length), (
            request.req_id
        )
        assert streams.finish[request.req_id] == ("stop" if request.req_id in stop_at else "length")
        assert request.num_pending == 0
    assert_idle(coordinator)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_preemption_with_a_step_in_flight_loses_and_repeats_no_token(mode):
    coordinator, streams = cell(mode=mode, decode_slots=1), Streams()
    normal = req("normal", max_tokens=20, priority=1)
    coordinator.admit(normal, consumer="c")
    run_overlapped(coordinator, streams, steps=6)
    coordinator.admit(req("urgent", max_tokens=4, priority=0), consumer="c")
    run_overlapped(coordinator, streams)
    assert streams.tokens == {
        "normal": expected_tokens("normal", 20),
        "urgent": expected_tokens("urgent", 4),
    }
    assert normal.num_preemptions == 1
    assert_idle(coordinator)


def test_the_timeline_summarizes_phases_and_busy_rate():
    from scheduler.cell.timeline import StepTimeline

    timeline = StepTimeline()
    # a burst of 4 steps counts as 4 steps of a quarter of its call's time each: the median step is
    # one of them
    for period, forward, tokens, steps in (
        (0.010, 0.008, 64, 1),
        (0.020, 0.015, 64, 1),
        (0.120, 0.108, 256, 4),
    ):
        timeline.record(
            "decode",
            period=period,
            plan=0.001,
            round_trip=period,
            worker_step=forward,
            forward=forward,
            apply=0.002,
            publish=0.0,
            tokens=tokens,
            steps=steps,
        )
    line = timeline.summary()["decode"]
    assert (
        line["steps"] == 6 and line["calls"] == 3 and line["steps_per_call"] == pytest.approx(2.0)
    )
    assert line["period_ms_p50"] == pytest.approx(30.0) and line["forward_ms_p50"] == pytest.approx(
        27.0
    )
    assert line["outside_forward_fraction"] == pytest.approx(1 - 0.131 / 0.150)
    assert line["tok_s_busy"] == pytest.approx(384 / 0.150)


def choices(n, prompt_len=6, max_tokens=5):
    prompt = list(range(1, prompt_len + 1))
    return [
        Request(
            req_id=f"x-{i}", prompt_ids=prompt, max_tokens=max_tokens, fork_of="x-0" if i else None
        )
        for i in range(n)
    ]


def test_n_choices_share_one_prefill_and_one_handoff():
    """Later choices wait for choice 0's handoff, go to its decode worker and copy its imported KV
    there."""
    coordinator, streams = cell(decode_slots=4, num_decode_workers=2), Streams()
    for choice in choices(3):
        coordinator.admit(choice, consumer="c")
    assert [r.req_id for r in coordinator.forks.by_sibling["x-0"]] == ["x-1", "x-2"]
    assert coordinator.prefill[0].step_planner.num_waiting == 1  # only choice 0 is prefilled
    copies = []
    record_steps(
        coordinator, lambda worker, plan, _: copies.extend((worker.name, c) for c in plan.copies)
    )
    step_all(coordinator, streams)
    assert streams.tokens == {f"x-{i}": expected_tokens(f"x-{i}", 5) for i in range(3)}
    assert coordinator.counts.handoffs == 1 and not coordinator.forks
    # a 6-token prompt: each later choice copies the one partly filled block, on one worker
    assert len(copies) == 2 and len({name for name, _ in copies}) == 1
    assert_idle(coordinator)


@pytest.mark.parametrize("aborted", ["x-0", "x-1"])
def test_aborting_a_choice_before_the_handoff(aborted):
    """A waiting choice ends at once; choice 0 ending first sends the others to compute their own
    prompt."""
    coordinator, streams = cell(decode_slots=4), Streams()
    for choice in choices(3):
        coordinator.admit(choice, consumer="c")
    assert coordinator.abort(aborted)
    step_all(coordinator, streams)
    assert streams.finish[aborted] == "abort" and streams.tokens.get(aborted, []) == []
    alive = [f"x-{i}" for i in range(3) if f"x-{i}" != aborted]
    assert {r: streams.tokens[r] for r in alive} == {r: expected_tokens(r, 5) for r in alive}
    assert coordinator.counts.handoffs == (1 if aborted == "x-1" else 2)
    assert_idle(coordinator)
    assert not coordinator.forks


def test_a_poll_joins_each_requests_successive_outputs_but_never_across_its_end():
    from scheduler.outputs import RequestOutput, coalesce

    outs = [
        RequestOutput("a", [1], "x"),
        RequestOutput("b", [7], "p"),
        RequestOutput("a", [2], "y"),
        RequestOutput("a", [3], "z", finish_reason="stop", metrics={"e2e_s": 1.0}),
        # the id in use again by a new request after the first ended
        RequestOutput("a", [9], "again"),
    ]
    joined = coalesce(outs)
    assert [(o.req_id, o.token_ids, o.text, o.finish_reason) for o in joined] == [
        ("a", [1, 2, 3], "xyz", "stop"),
        ("b", [7], "p", None),
        ("a", [9], "again", None),
    ]
    assert joined[0].metrics == {"e2e_s": 1.0}


def run_woken(coordinator, streams, check=lambda: None):
    """As the actor's loops step workers: one plans again after its own step or when the coordinator
    wakes it; with nothing to do it sleeps. Fails if work is left with every worker asleep."""
    awake = {w.name for w in coordinator.workers}
    coordinator.wake = lambda worker: awake.add(worker.name)
    while awake:
        for worker in coordinator.workers:
            step = coordinator.next_step(worker) if worker.name in awake else None
            if step is None:
                awake.discard(worker.name)
                continue
            coordinator.apply(worker, step[0], fake_step(coordinator, worker, *step))
            streams.take(coordinator)
            check()


def test_the_prefill_pool_runs_at_most_one_round_ahead_of_the_decode_pool():
    """An overload queues prompts, not KV: handed-off prompts waiting for a decode slot and prompts
    still prefilling never outnumber the decode pool's free slots plus the prefill pool's slots
    (without that bound, all 12 prompts would be prefilled into the object store at once). A prefill
    worker holding prompts back is woken when a decode slot frees; no stream changes."""
    coordinator, streams = cell(decode_slots=2, prefill_slots=1), Streams()
    for i in range(12):
        coordinator.admit(req(f"r{i}", max_tokens=15), consumer="c")
    most_waiting = 0

    def bounded():
        (prefill,), (decode,) = coordinator.prefill, coordinator.decode
        assert (
            decode.step_planner.num_waiting + len(prefill.step_planner.running)
            <= len(decode.step_planner.free_slots) + 1
        )
        nonlocal most_waiting
        most_waiting = max(most_waiting, len(coordinator.kv.handoffs))

    run_woken(coordinator, streams, bounded)
    assert streams.tokens == {f"r{i}": expected_tokens(f"r{i}", 15) for i in range(12)}
    assert most_waiting == 1  # one prompt ready for the next free decode slot, no more
    assert_idle(coordinator)


def test_an_urgent_prompt_passes_the_bound_to_preempt_at_once():
    """The backlog is full and every decode slot is held by long, less urgent streams: an urgent
    prompt still starts on the prefill pool, is handed off and preempts; it does not wait for a
    stream to end."""
    coordinator, streams = cell(decode_slots=2, prefill_slots=1), Streams()
    for i in range(6):
        coordinator.admit(req(f"low{i}", max_tokens=40, priority=1), consumer="c")
    arrived = []

    def urgent_after_backlog():
        if (
            not arrived
            and len(coordinator.kv.handoffs) == 1
            and not coordinator.decode[0].step_planner.free_slots
        ):
            coordinator.admit(req("urgent", max_tokens=3, priority=0), consumer="c")
            arrived.append(len(streams.finish))

    run_woken(coordinator, streams, urgent_after_backlog)
    assert arrived == [0]
    assert list(streams.finish)[0] == "urgent"  # before any of the streams it preempted ends
    assert streams.tokens == {"urgent": expected_tokens("urgent", 3)} | {
        f"low{i}": expected_tokens(f"low{i}", 40) for i in range(6)
    }
    assert_idle(coordinator)


def test_a_conversations_next_turn_is_prefilled_where_its_history_is_cached():
    """The decode worker that generated a reply holds it (and the prompt before it) as named
    blocks: the next turn goes there and computes only what is new, with no prefill and no
    handoff; the ledger checks it reads the right rows."""
    coordinator = cell(prefix_caching=True, capacity=128, token_budget=16, prefill_chunk=8)
    streams = Streams()
    first = Request(req_id="t1", prompt_ids=list(range(1, 38)), max_tokens=12)
    coordinator.admit(first, consumer="c")
    step_all(coordinator, streams)
    assert coordinator.counts.handoffs == 1
    history = first.prompt_ids + streams.tokens["t1"]  # 49 tokens: 3 full blocks cached
    follow = Request(req_id="t2", prompt_ids=history + [90, 91, 92, 93, 94], max_tokens=4)
    chunks = []
    record_steps(
        coordinator,
        lambda worker, plan, imports: chunks.extend((worker.name, c) for c in plan.chunks),
    )
    coordinator.admit(follow, consumer="c")
    step_all(coordinator, streams)
    assert streams.tokens["t2"] == expected_tokens("t2", 4)
    assert coordinator.counts.handoffs == 1  # none for the second turn
    prompt_len = len(follow.prompt_ids)
    computed = [(name, c.start_pos, c.num_tokens) for name, c in chunks if c.start_pos < prompt_len]
    assert computed == [("decode-0", 48, 6)]
    assert follow.num_cached == 48
    assert_idle(coordinator)


@pytest.mark.parametrize("decode_slots", [1, 4], ids=["at-handoff", "reserved-early"])
def test_a_handoff_skips_the_blocks_the_decode_worker_has_cached(decode_slots):
    """Two prompts on one system prompt: the second's KV goes to the decode worker that holds the
    first's, which keeps its cached blocks and copies in only the rest (into blocks taken at the
    handoff, or reserved while the prompt prefills); the ledger checks the rows it reads."""
    coordinator = cell(
        prefix_caching=True, decode_slots=decode_slots, capacity=128, token_budget=16
    )
    streams = Streams()
    imports = []
    record_steps(
        coordinator,
        lambda worker, plan, items: imports.extend((i.handoff.req_id, i.held) for i in items),
    )
    system = list(range(1, 41))  # 2 full blocks and a half
    coordinator.admit(Request(req_id="a", prompt_ids=system + [50, 51], max_tokens=3), "c")
    step_all(coordinator, streams)
    # b's own 30 tokens are too many for the decode worker to compute: b is prefilled, handed off
    tail = list(range(60, 90))
    coordinator.admit(Request(req_id="b", prompt_ids=system + tail, max_tokens=3), "c")
    step_all(coordinator, streams)
    assert streams.tokens == {"a": expected_tokens("a", 3), "b": expected_tokens("b", 3)}
    assert {held for req_id, held in imports if req_id == "a"} == {0}
    assert {held for req_id, held in imports if req_id == "b"} == {32}
    assert_idle(coordinator)


def test_blocks_a_handoff_found_cached_are_imported_after_all_when_the_decode_worker_restarts():
    """b is handed off to blocks reserved on the decode worker that has its system prompt cached;
    that worker dies before b's import and comes back empty: b's KV is imported whole (the ledger,
    emptied with the worker, checks every row b reads)."""
    coordinator = cell(prefix_caching=True, decode_slots=4, capacity=128, token_budget=16)
    streams = Streams()
    system = list(range(1, 41))
    coordinator.admit(Request(req_id="a", prompt_ids=system + [50, 51], max_tokens=3), "c")
    step_all(coordinator, streams)
    decode = coordinator.decode[0]
    restarted = []
    apply = coordinator.apply

    def apply_then_kill(worker, plan, result):  # right after the handoff, before the import
        apply(worker, plan, result)
        if not restarted and "b" in coordinator.kv.handoffs and "b" in decode.step_planner.reserved:
            assert decode.step_planner.held["b"] == 32
            coordinator.worker_died(decode)
            coordinator.worker_back(decode, decode.ready_info)
            restarted.append(True)

    coordinator.apply = apply_then_kill
    tail = list(range(60, 90))
    coordinator.admit(Request(req_id="b", prompt_ids=system + tail, max_tokens=3), "c")
    step_all(coordinator, streams)
    assert restarted
    assert streams.tokens["b"] == expected_tokens("b", 3)
    assert_idle(coordinator)


def test_a_handoff_holding_the_last_seat_goes_in_ahead_of_more_urgent_ones_that_wait():
    """The decode worker's one seat is reserved for a prompt prefilling on one prefill worker
    (its KV is imported as it comes) when urgent prompts arrive and are prefilled on the other.
    They queue ahead of it on the decode worker, and none can go in while it holds the seat: it
    goes in past them, or neither it nor they would ever run."""
    coordinator, streams = cell(num_prefill_workers=2, decode_slots=1, prefill_slots=1), Streams()
    low = req("low", prompt_len=40, max_tokens=3, priority=1)
    coordinator.admit(low, consumer="c")
    run_overlapped(coordinator, streams, steps=2)
    decode = next(w for w in coordinator.workers if w.kind == "decode")
    assert "low" in decode.step_planner.reserved
    urgent = [req(f"u{i}", prompt_len=4, max_tokens=3, priority=0) for i in range(2)]
    for request in urgent:
        coordinator.admit(request, consumer="c")
    run_overlapped(coordinator, streams, steps=2000)
    for request in [low, *urgent]:
        assert streams.tokens[request.req_id] == expected_tokens(request.req_id, 3)
    assert_idle(coordinator)


def test_a_lost_final_import_leaves_no_block_cached_and_its_recompute_is_exact():
    """The decode worker names a handed-off prompt's full blocks only once a step has imported
    them whole: named when planned, the blocks of a lost import stayed cached, and the prompt's
    recompute (or any prompt sharing its prefix) took them as held and read rows never written."""
    coordinator, streams = (
        cell(decode_slots=1, token_budget=4, prefill_chunk=4, block_size=4, prefix_caching=True),
        Streams(),
    )
    coordinator.admit(req("x", prompt_len=12, max_tokens=4), consumer="c")
    run_overlapped(coordinator, streams, lose_once={"x"}, final_only=True)
    assert coordinator.counts.recomputes == 1
    assert streams.tokens["x"] == expected_tokens("x", 4)
    assert_idle(coordinator)


def test_a_result_planned_for_an_earlier_seat_neither_exports_nor_hands_off():
    """An early import of a prompt is lost while its last chunk is in flight; its recompute on the
    same prefill worker finds the prompt cached and takes a seat again before that chunk's result
    comes. That result is void: its KV piece and handoff were taken for the new seat's, and the
    decode worker imported a prompt with rows missing."""
    coordinator, streams = (
        cell(token_budget=4, prefill_chunk=4, block_size=4, prefix_caching=True),
        Streams(),
    )
    coordinator.admit(req("a", prompt_len=12, max_tokens=4), consumer="c")
    run_overlapped(coordinator, streams, lose_once={"a"})
    assert coordinator.counts.recomputes == 1
    assert streams.tokens["a"] == expected_tokens("a", 4)
    assert_idle(coordinator)


def test_a_reservation_given_back_for_a_growing_answer_is_imported_whole_at_the_handoff():
    """The decode worker reserves blocks for a prompt prefilling one token a step and imports its
    pieces into them; its running answer needs them and takes them back; the prompt reserves
    again later. The pieces imported into the first reservation are void: its handoff must bring
    every piece again, not start after those."""
    coordinator, streams = (
        cell(decode_slots=2, decode_blocks=9, capacity=32, block_size=4, prefill_chunk=1),
        Streams(),
    )
    coordinator.admit(req("r", prompt_len=4, max_tokens=20), consumer="c")
    run_overlapped(coordinator, streams, steps=1)
    coordinator.admit(req("p", prompt_len=20, max_tokens=4), consumer="c")
    decode = coordinator.decode[0]
    dropped, take = [], decode.step_planner.take_dropped_reservations

    def taking():
        taken = take()
        dropped.extend(taken)
        return taken

    decode.step_planner.take_dropped_reservations = taking
    run_overlapped(coordinator, streams)
    assert dropped == ["p"]
    assert streams.tokens == {"r": expected_tokens("r", 20), "p": expected_tokens("p", 4)}
    assert_idle(coordinator)

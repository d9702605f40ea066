"""The handoff book: a prompt is bound to its decode worker from its first KV piece, and each piece
is named to that worker as soon as it exists when the worker is on another node (so it can pull the
bytes while the prompt still prefills), and imported into a slot reserved for it there when the
worker has one to spare. Driven without Ray, as tests/scheduler/cell/test_coordinator.py does (whose
fake decode worker checks every chunk finds its request's rows in its slot)."""

import pytest

from scheduler.cell.handoffs import HandoffBook
from scheduler.cell.state import WorkerStatus, prefill_room
from scheduler.messages import KVHandoff, KVPiece
from scheduler.plan import Chunk, StepPlan
from scheduler.request import SamplingParams
from tests.scheduler.cell.cells import (
    Streams,
    assert_idle,
    cell,
    expected_tokens,
    req,
    run_overlapped,
    step_all,
)


def run(coordinator, streams, before_step=None):
    """Step every worker until idle; returns (piece refs by request, refs named to each decode
    worker, the decode worker that imported each request)."""
    pieces, named, imported = {}, {}, {}

    def observe(worker, imports, result):
        for item in imports:
            imported[item.handoff.req_id] = worker.name
            assert [p.ref for p in item.handoff.pieces] == pieces[item.handoff.req_id][
                : len(item.handoff.pieces)
            ]
        for piece in result.kv_pieces:
            pieces.setdefault(piece.req_id, []).append(piece.ref)
        for name, named_pieces in coordinator.kv.take_prefetches().items():
            named.setdefault(name, []).extend(piece.ref for piece in named_pieces)

    step_all(coordinator, streams, before_step=before_step, observe=observe)
    return pieces, named, imported


def place(coordinator, **nodes):
    for worker in coordinator.workers:
        worker.ready_info = {"node_id": nodes[worker.name.replace("-", "")]}


def test_pieces_go_to_the_decode_worker_of_another_node_as_they_are_made_and_prompts_spread():
    coordinator, streams = cell(num_decode_workers=2, prefill_slots=4, decode_slots=4), Streams()
    place(coordinator, prefill0="a", decode0="b", decode1="c")
    for i in range(4):
        coordinator.admit(req(f"p{i}", prompt_len=12), consumer="c")  # 3 chunks of 4: 3 pieces each
    pieces, named, imported = run(coordinator, streams)
    assert sorted(imported.values()) == ["decode-0", "decode-0", "decode-1", "decode-1"]
    assert imported["p0"] != imported["p1"]  # prefilled side by side: bound to one worker each
    for req_id, refs in pieces.items():
        assert len(refs) == 3
        # each piece named there
        assert all(any(ref is r for r in named[imported[req_id]]) for ref in refs)
        other = "decode-1" if imported[req_id] == "decode-0" else "decode-0"
        assert not any(ref is r for ref in refs for r in named.get(other, []))
        assert streams.tokens[req_id] == expected_tokens(req_id, 5)
    assert_idle(coordinator)


def test_nothing_is_named_when_prefill_and_decode_share_a_node():
    coordinator, streams = cell(), Streams()
    place(coordinator, prefill0="a", decode0="a")
    coordinator.admit(req("x", prompt_len=12), consumer="c")
    pieces, named, imported = run(coordinator, streams)
    assert len(pieces["x"]) == 3 and imported == {"x": "decode-0"} and named == {}
    assert streams.tokens["x"] == expected_tokens("x", 5)
    assert_idle(coordinator)


def test_a_prompt_whose_decode_worker_dies_while_it_prefills_goes_to_a_live_one():
    coordinator, streams = cell(num_decode_workers=2), Streams()
    place(coordinator, prefill0="a", decode0="b", decode1="c")
    coordinator.admit(req("x", prompt_len=16), consumer="c")  # 4 chunks

    def kill_its_decode_worker(n):
        if n == 1:
            bound = coordinator.kv.bound["x"]
            coordinator.worker_died(bound)
            bound.status = WorkerStatus.GONE  # and never comes back

    pieces, named, imported = run(coordinator, streams, before_step=kill_its_decode_worker)
    live = next(w.name for w in coordinator.decode if w.status is WorkerStatus.UP)
    assert imported == {"x": live} and streams.tokens["x"] == expected_tokens("x", 5)
    assert any(ref is r for ref in pieces["x"][2:] for r in named[live])  # later pieces named to it
    assert_idle(coordinator)


def test_abort_while_prefilling_forgets_the_binding_and_every_piece():
    coordinator, streams = cell(), Streams()
    place(coordinator, prefill0="a", decode0="b")
    coordinator.admit(req("x", prompt_len=16), consumer="c")

    def abort_mid_prompt(n):
        if n == 2:
            assert "x" in coordinator.kv.bound and coordinator.kv.pieces["x"]
            assert coordinator.abort("x")

    run(coordinator, streams, before_step=abort_mid_prompt)
    assert streams.finish["x"] == "abort"
    assert_idle(coordinator)


def early_and_final_imports(
    coordinator, streams, before_step=None, lose_first_early=False, seen=None
):
    """Step every worker until idle; returns (and fills `seen`) per request each import into a
    decode worker as (worker, blocks, first piece imported, pieces in the handoff, final)."""
    seen, lose = {} if seen is None else seen, set()

    def observe(worker, imports, result):
        for item in imports:
            h = item.handoff
            seen.setdefault(h.req_id, []).append(
                (worker.name, tuple(item.block_table), h.imported, len(h.pieces), item.final)
            )
            if lose_first_early and not item.final:
                lose.discard(h.req_id)  # lost once
        if lose_first_early and not seen:
            lose.update(r for w in coordinator.decode for r in w.step_planner.reserved)

    step_all(coordinator, streams, before_step=before_step, observe=observe, lose_imports=lose)
    return seen


def steady_and_long(coordinator, streams):
    """A request decoding on each decode worker (so they step) while a 4-chunk prompt prefills."""
    for worker in coordinator.decode:
        coordinator.admit(
            req(f"steady{worker.index or ''}", prompt_len=4, max_tokens=30), consumer="c"
        )
    step_all(coordinator, streams, steps=3)
    coordinator.admit(req("long", prompt_len=16), consumer="c")


def test_pieces_are_imported_into_a_reserved_slot_as_the_prompt_prefills():
    coordinator, streams = cell(decode_slots=4), Streams()
    steady_and_long(coordinator, streams)
    imports = early_and_final_imports(coordinator, streams)["long"]
    early, final = [i for i in imports if not i[4]], [i for i in imports if i[4]]
    # pieces went in while it prefilled; the last one at handoff
    assert len(early) >= 2 and len(final) == 1
    slot = {i[1] for i in imports}
    # one slot of one worker, reserved throughout
    assert len(slot) == 1 and len({i[0] for i in imports}) == 1
    firsts = [i[2] for i in imports]
    assert firsts == sorted(set(firsts)) and firsts[0] == 0  # each piece once, in order
    assert final[0][2] == final[0][3] - 1  # only the last piece is left for the handoff
    assert coordinator.counts.early_imports == len(early)
    assert streams.tokens["long"] == expected_tokens("long", 5)
    assert_idle(coordinator)


def test_no_slot_is_reserved_when_none_is_to_spare():
    coordinator, streams = cell(decode_slots=1), Streams()
    steady_and_long(coordinator, streams)
    imports = early_and_final_imports(coordinator, streams)["long"]
    # every piece at the handoff, once the slot is free
    assert [i[2:] for i in imports] == [(0, 4, True)]
    assert coordinator.counts.early_imports == 0
    assert streams.tokens["long"] == expected_tokens("long", 5)
    assert streams.tokens["steady"] == expected_tokens("steady", 30)
    assert_idle(coordinator)


def test_a_reserved_slot_counts_once_in_the_prefill_pools_room():
    coordinator = cell(decode_slots=2)
    coordinator.admit(req("x", prompt_len=16), consumer="c")
    prefill, decode = coordinator.prefill[0], coordinator.decode[0]
    step_all(coordinator, Streams(), steps=1)
    assert decode.step_planner.reserved and len(decode.step_planner.free_slots) == 1
    # 2 decode slots + 1 - x
    assert prefill_room(prefill, coordinator.prefill, coordinator.decode, 1) == 2


@pytest.mark.parametrize("when", ["prefilling", "handed off"])
def test_a_decode_worker_that_dies_loses_what_was_imported_into_its_slots(when):
    """Restarted with a prompt's pieces in a reserved slot, or gone with a handed-off prompt waiting
    there: either way every piece is imported again where it goes (the ledger checks the rows)."""
    coordinator, streams = cell(num_decode_workers=2, decode_slots=4), Streams()
    steady_and_long(coordinator, streams)
    killed, imports = [], {}
    original = coordinator.apply

    # right after a step: the handoff is not imported yet
    def apply_then_kill(worker, plan, result):
        original(worker, plan, result)
        decode = coordinator.kv.bound.get("long") or next(
            (w for w in coordinator.decode if "long" in w.step_planner.requests), None
        )
        ready = (
            "long" in coordinator.kv.handoffs
            if when == "handed off"
            else coordinator.kv.sent.get("long")
        )
        if not killed and decode is not None and ready:
            coordinator.worker_died(decode)
            killed.append(len(imports.get("long", [])))
            if when == "prefilling":
                coordinator.worker_back(decode, decode.ready_info)  # restarted, its cache empty
            else:
                decode.status = WorkerStatus.GONE

    coordinator.apply = apply_then_kill
    early_and_final_imports(coordinator, streams, seen=imports)
    assert killed, when
    after = imports["long"][killed[0] :]
    assert after[0][2] == 0 and after[-1][4]  # from the first piece again
    assert streams.tokens["long"] == expected_tokens("long", 5)
    assert streams.tokens["steady"] == expected_tokens("steady", 30)
    assert_idle(coordinator)


def test_a_prompt_preempted_on_the_prefill_worker_imports_its_pieces_again():
    coordinator, streams = cell(decode_slots=4), Streams()
    steady_and_long(coordinator, streams)
    coordinator.prefill[0].step_planner.requests["long"].priority = 1

    def urgent(n):
        if n == 2:
            assert coordinator.kv.sent.get("long")  # pieces are in its reserved slot
            coordinator.admit(req("urgent", prompt_len=8, priority=0), consumer="c")

    imports = early_and_final_imports(coordinator, streams, before_step=urgent)["long"]
    assert coordinator.prefill[0].step_planner.num_preemptions == 1
    # imported from its first piece again after the preemption
    assert [i[2] for i in imports].count(0) == 2
    for req_id in ("long", "urgent"):
        assert streams.tokens[req_id] == expected_tokens(req_id, 5)
    assert_idle(coordinator)


def test_a_lost_early_import_recomputes_the_prompt():
    coordinator, streams = cell(decode_slots=4), Streams()
    steady_and_long(coordinator, streams)
    early_and_final_imports(coordinator, streams, lose_first_early=True)
    assert coordinator.counts.recomputes == 1
    assert streams.tokens["long"] == expected_tokens("long", 5)
    assert_idle(coordinator)


# every piece imported at the handoff; or only the last
@pytest.mark.parametrize("decode_slots", [1, 4])
def test_with_a_step_in_flight_each_handoff_is_imported_once(decode_slots):
    """A decode worker's step N+1 is planned before step N's results (which say what N imported) are
    applied: N+1 must not import N's handoffs again (a second copy of every row, on the token's
    path)."""
    coordinator, streams, finals = cell(decode_slots=decode_slots, token_budget=16), Streams(), []
    plan_step = coordinator.next_step

    def recording(worker):
        step = plan_step(worker)
        finals.extend(i.handoff.req_id for i in (step[1] if step else ()) if i.final)
        return step

    coordinator.next_step = recording
    for i in range(3):
        coordinator.admit(req(f"r{i}", prompt_len=9 + 4 * i, max_tokens=6), consumer="c")
    run_overlapped(coordinator, streams)
    assert sorted(finals) == ["r0", "r1", "r2"]
    assert streams.tokens == {f"r{i}": expected_tokens(f"r{i}", 6) for i in range(3)}
    assert_idle(coordinator)


def test_an_import_done_after_its_handoff_was_replaced_leaves_the_new_one():
    """A request preempted on its decode worker while a step imports its handoff is prefilled again
    and handed off anew; if that happens before the step's result comes, the result is about the old
    handoff."""
    book, decode = (
        HandoffBook(),
        StepPlan(decode=[Chunk("r", 0, [5], 8, True, 0, SamplingParams())], prefill=[]),
    )
    old, new = (KVHandoff("r", (KVPiece("r", 0, 8, object(), 100, 0.001),), 0) for _ in range(2))
    book.book(old)
    assert [i.handoff for i in book.final_imports(decode, {})] == [old]
    assert book.final_imports(decode, {}) == []  # the step planned next does not import it again
    book.book(new)
    assert book.imported("r") is None and book.handoffs["r"] is new
    assert [i.handoff for i in book.final_imports(decode, {})] == [new]
    assert book.imported("r") is new and not book.handoffs and not book.importing


def test_an_idle_decode_worker_imports_the_pieces_as_the_prompt_prefills():
    """With nothing to decode, the worker the prompt is bound to gets steps that only import its
    pieces, so the handoff leaves only the last piece to copy there as well."""
    coordinator, streams = cell(decode_slots=4), Streams()
    coordinator.admit(req("long", prompt_len=16), consumer="c")
    imports = early_and_final_imports(coordinator, streams)["long"]
    slot = imports[0][1]
    assert imports == [("decode-0", slot, i, i + 1, False) for i in range(3)] + [
        ("decode-0", slot, 3, 4, True)
    ]
    assert coordinator.counts.early_imports == 3
    assert streams.tokens["long"] == expected_tokens("long", 5)
    assert_idle(coordinator)

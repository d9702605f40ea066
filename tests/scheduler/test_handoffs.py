"""The handoff book: a prompt is bound to its decode worker from its first KV piece, and each piece is
named to that worker as soon as it exists when the worker is on another node (so it can pull the bytes
while the prompt still prefills). Driven without Ray, as tests/scheduler/test_coordinator.py does."""

from scheduler.cell import WorkerStatus
from tests.scheduler.test_coordinator import Streams, assert_idle, cell, expected_tokens, req, step_all


def run(coordinator, streams, before_step=None):
    """Step every worker until idle; returns (piece refs by request, refs named to each decode worker,
    the decode worker that imported each request)."""
    pieces, named, imported = {}, {}, {}

    def observe(worker, imports, result):
        for item in imports:
            imported[item.handoff.req_id] = worker.name
            assert [p.ref for p in item.handoff.pieces] == pieces[item.handoff.req_id]
        for piece in result.kv_pieces:
            pieces.setdefault(piece.req_id, []).append(piece.ref)
        for name, refs in coordinator.kv.take_prefetches().items():
            named.setdefault(name, []).extend(refs)

    step_all(coordinator, streams, before_step=before_step, observe=observe)
    return pieces, named, imported


def place(coordinator, **nodes):
    for worker in coordinator.workers:
        worker.placement = {"node_id": nodes[worker.name.replace("-", "")]}


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
        assert all(any(ref is r for r in named[imported[req_id]]) for ref in refs)  # each piece named there
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

"""The scheduler actor's lifecycle: abort in every state, lost handoffs, dead workers, a full
queue."""

import asyncio
import json
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from ray._private.internal_api import memory_summary

from deploy.config import EngineConfig
from deploy.driver import RayEngine, open_engine
from deploy.engine_client import EngineClient, complete
from deploy.ray_cell import start_cell_actor
from scheduler.cell.state import CellClosed
from scheduler.step_planner import QueueFullError
from tests.deploy.worker_doubles import Gate, HeldWorker, start_engine
from tests.factories import make_request, make_requests
from tests.waiting import wait_for, wait_for_async, wait_for_stats

pytestmark = pytest.mark.slow


def plasma_objects() -> int:
    """Objects in Ray's object store, counted by Ray itself (independent of the scheduler's
    books); asked of this test's Ray by its address (another Ray on the host makes "auto"
    ambiguous)."""
    address = ray.get_runtime_context().gcs_address
    summary = memory_summary(address=address, stats_only=True)
    return int(re.search(r"(\d+) objects", summary).group(1))


def streamer(handle):
    """stream(request) -> its Completion, all through one consumer of the scheduler."""
    client = EngineClient(handle)
    return lambda request: complete(client, request)


def local_outputs(config, requests):
    with open_engine(config.model_copy(update={"mode": "local"})) as engine:
        return {k: c.token_ids for k, c in engine.run(requests).items()}


def req(req_id, prompt_len, max_tokens, seed=0):
    return make_request(req_id, prompt_len, max_tokens, seed=seed)


def crowded_config(checkpoint, **kw):
    """Two decode slots and one prefill row, four-token steps, one decode step per call (no bursts):
    easy to hold requests in each state long enough."""
    return EngineConfig(
        **dict(
            model=checkpoint,
            mode="disaggregated",
            slots=2,
            prefill_slots=1,
            max_model_len=640,
            token_budget=4,
            prefill_chunk=4,
            max_burst_ms=0,
        )
        | kw
    )


def test_abort_in_every_state_frees_slots_and_handoff_objects(ray_session, tiny_checkpoint):
    # objects an earlier test left in the shared Ray (after test_lost_handoff_is_prefilled_again
    # kills an object owner, 2 stay, referenced by no live process) are not this test's
    before = plasma_objects()
    handle = start_cell_actor(crowded_config(tiny_checkpoint, prefill_slots=2))
    stream = streamer(handle)
    decode, prefill = "decode-0", "prefill-0"

    async def scenario():
        tasks = {
            r.req_id: asyncio.create_task(stream(r))
            for r in (req("A", 4, 600, 1), req("B", 4, 600, 2))
        }
        await wait_for_stats(handle, lambda s: s["workers"][decode]["running"] == 2)
        tasks["C"] = asyncio.create_task(stream(req("C", 6, 10, 3)))  # prefilled, then waits
        await wait_for_stats(handle, lambda s: s["live_handoffs"] == 1)
        assert plasma_objects() >= 1
        tasks["D"] = asyncio.create_task(stream(req("D", 500, 5, 4)))  # 125 four-token chunks
        # waits: C and D fill `prefill_room`
        tasks["E"] = asyncio.create_task(stream(req("E", 10, 5, 5)))
        stats = await wait_for_stats(
            handle,
            lambda s: (
                s["workers"][prefill]["running"] == 1 and s["workers"][prefill]["waiting"] == 1
            ),
        )
        line = stats["workers"][decode]
        assert {k: line[k] for k in ("alive", "slots_used", "running", "waiting")} == {
            "alive": True,
            "slots_used": 2,
            "running": 2,
            "waiting": 1,
        }
        for req_id in ("E", "D", "C", "A"):  # waiting, prefilling, in handoff, decoding
            assert await handle.abort.remote(req_id)
        done = {k: await tasks[k] for k in ("A", "C", "D", "E")}
        assert {c.finish_reason for c in done.values()} == {"abort"}
        assert len(done["A"].token_ids) < 600 and done["D"].token_ids == []
        stats = await handle.stats.remote()
        assert stats["live_handoffs"] == 0
        assert (
            stats["workers"][prefill]["slots_used"] == 0
            and stats["workers"][decode]["slots_used"] == 1
        )
        # D's blocks are given back on the prefill worker, A's and C's on the decode worker
        assert stats["workers"][prefill]["kv_cache"]["blocks_used"] == 0
        assert 0 < stats["workers"][decode]["kv_cache"]["blocks_used"] <= (4 + 600) // 16 + 1
        assert not await handle.abort.remote("A")  # already gone
        assert await handle.abort.remote("B")
        await tasks["B"]
        return await handle.stats.remote()

    try:
        stats = asyncio.run(scenario())
        assert all(w["slots_used"] == 0 and w["waiting"] == 0 for w in stats["workers"].values())
        # freed asynchronously
        wait_for(lambda n: n <= before, 10, value=plasma_objects, what="the handoff objects freed")
    finally:
        ray.get(handle.shutdown.remote())


def test_a_closed_stream_aborts_its_request(ray_session, tiny_checkpoint):
    handle = start_cell_actor(crowded_config(tiny_checkpoint))
    client = EngineClient(handle)

    async def scenario():
        outputs = client.generate(req("X", 4, 600))
        await outputs.__anext__()  # first output arrived: it is decoding
        await outputs.aclose()  # what the ingress does when an HTTP client disconnects
        return await wait_for_stats(
            handle, lambda s: s["workers"]["decode-0"]["slots_used"] == 0, timeout_s=20
        )

    try:
        stats = asyncio.run(scenario())
        assert stats["streams"] == 0
    finally:
        ray.get(handle.shutdown.remote())


def test_outputs_of_many_streams_arrive_in_few_messages(ray_session, tiny_checkpoint):
    """Outputs are batched per step per consumer: 8 streams of 40 tokens take far fewer polls than
    the 320 messages a per-token stream would send, and every stream still gets all its tokens."""
    config = EngineConfig(
        model=tiny_checkpoint,
        mode="disaggregated",
        slots=8,
        max_model_len=128,
        token_budget=64,
        prefill_chunk=16,
    )
    handle = start_cell_actor(config)
    client = EngineClient(handle)

    async def scenario():
        return await asyncio.gather(*(complete(client, req(f"r{i}", 6, 40, i)) for i in range(8)))

    try:
        done = asyncio.run(scenario())
    finally:
        ray.get(handle.shutdown.remote())
    assert [len(c.token_ids) for c in done] == [40] * 8 and {c.finish_reason for c in done} == {
        "length"
    }
    assert client.num_polls < 8 * 40 / 4, client.num_polls


def test_full_queue_and_oversized_requests_are_rejected_at_once(ray_session, tiny_checkpoint):
    handle = start_cell_actor(crowded_config(tiny_checkpoint, max_waiting=1))
    stream = streamer(handle)

    async def scenario():
        running = [asyncio.create_task(stream(req("long", 600, 5)))]  # holds the prefill row
        await wait_for_stats(handle, lambda s: s["workers"]["prefill-0"]["running"] == 1)
        running.append(asyncio.create_task(stream(req("next", 4, 5))))
        await wait_for_stats(handle, lambda s: s["workers"]["prefill-0"]["waiting"] == 1)
        with pytest.raises(QueueFullError, match="full"):
            await stream(req("late", 4, 5))
        with pytest.raises(ValueError, match="over the context limit of 640"):
            await stream(req("huge", 600, 100))
        for task in running:  # the queued requests were not disturbed
            assert (await task).finish_reason == "length"

    try:
        asyncio.run(scenario())
    finally:
        ray.get(handle.shutdown.remote())


def test_a_draining_cell_refuses_new_requests_and_ends_when_its_open_ones_have(
    ray_session, tiny_checkpoint
):
    """What a Cell replica being scaled down does: the open request runs to its end, a new one is
    refused (the ingress places it on another cell), and the drain returns only after the open one
    ended."""
    handle = start_cell_actor(crowded_config(tiny_checkpoint))
    stream = streamer(handle)

    async def scenario():
        running = asyncio.create_task(stream(req("open", 4, 400)))
        await wait_for_stats(handle, lambda s: s["workers"]["decode-0"]["running"] == 1)
        assert await handle.num_open.remote() == 1
        drained = asyncio.wrap_future(handle.drain.remote().future())
        with pytest.raises(CellClosed, match="draining"):
            await stream(req("late", 4, 5))
        assert not drained.done() and not running.done()
        done = await running
        await asyncio.wait_for(drained, 30)
        return done, await handle.num_open.remote()

    try:
        done, still_open = asyncio.run(scenario())
    finally:
        ray.get(handle.shutdown.remote())
    assert done.finish_reason == "length" and len(done.token_ids) == 400 and still_open == 0


def long_context(checkpoint, tmp_path, context=8192):
    """The same checkpoint with a longer context (its rotary embedding does not depend on it)."""
    path = tmp_path / "long-context"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": context}))
    return str(path)


def test_lost_handoff_is_prefilled_again(ray_session, tiny_checkpoint, tmp_path):
    """Kill the prefill worker while a handoff waits for a decode slot: its bytes die with their
    owner, the import fails, the request is prefilled again and still produces local mode's tokens.
    The two requests holding the slots must outlast the kill and the worker's restart."""
    config = crowded_config(long_context(tiny_checkpoint, tmp_path), max_model_len=8192)
    expected = local_outputs(config, [req("C", 6, 12, 3)])["C"]
    handle = start_cell_actor(config)
    stream = streamer(handle)
    waiting = req("C", 6, 12, 3)

    async def scenario():
        hogs = [asyncio.create_task(stream(req(n, 4, 8000, i))) for i, n in enumerate("AB")]
        await wait_for_stats(handle, lambda s: s["workers"]["decode-0"]["running"] == 2)
        task = asyncio.create_task(stream(waiting))
        await wait_for_stats(handle, lambda s: s["live_handoffs"] == 1)
        prefill = (await handle.worker_handles.remote())["prefill-0"]
        killed = (await prefill.ready.remote())["incarnation"]
        ray.kill(prefill, no_restart=False)
        await restarted(prefill, killed)  # the handoff's owner is dead; then a slot frees
        await handle.abort.remote("A")
        done = await asyncio.wait_for(task, timeout=120)
        await handle.abort.remote("B")
        await asyncio.gather(*hogs)
        return done, await handle.stats.remote()

    try:
        done, stats = asyncio.run(scenario())
        assert done.token_ids == expected and done.finish_reason == "length"
        assert stats["counters"]["recomputes"] >= 1 and stats["live_handoffs"] == 0
    finally:
        ray.get(handle.shutdown.remote())


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "draft-model"])
def test_killed_workers_lose_no_request(ray_session, tiny_checkpoint, speculate):
    """Kill the prefill and the decode worker mid-run: every request completes with local mode's
    tokens (recomputed from prompt + streamed tokens) or ends with an error; nothing hangs. With
    speculation by a draft model (the checkpoint drafting for itself), the restarted decode
    worker's draft model reads every recomputed request again: each of its drafts is right."""
    draft = {"model": tiny_checkpoint, "num_speculative_tokens": 3} if speculate else None
    config = EngineConfig(
        model=tiny_checkpoint,
        mode="disaggregated",
        slots=3,
        prefill_slots=2,
        max_model_len=512,
        token_budget=8,
        prefill_chunk=4,
        speculative_config=draft,
    )

    def workload():
        return make_requests(10, [5, 40, 12, 70, 9], [20, 250, 300, 240, 280])

    expected = local_outputs(config.model_copy(update={"speculative_config": None}), workload())
    engine = RayEngine(config)
    workers = ray.get(engine.handle.worker_handles.remote())
    kills = threading.Event()

    def kill_workers():
        ray.kill(workers["prefill-0"], no_restart=False)
        time.sleep(0.2)  # two faults apart, not one
        ray.kill(workers["decode-0"], no_restart=False)
        kills.set()

    def on_finish(completion):  # the first (short) request is done: the long ones are mid-stream
        if not kills.is_set() and not getattr(on_finish, "started", False):
            on_finish.started = True
            threading.Thread(target=kill_workers, daemon=True).start()

    # nothing hangs: a run still going after 240 s fails (the engine's close then ends it)
    run = ThreadPoolExecutor(1)
    try:
        results = run.submit(engine.run, workload(), on_finish=on_finish).result(timeout=240)
        stats = engine.stats()
    finally:
        run.shutdown(wait=False)
        engine.close()
    assert kills.is_set() and len(results) == 10
    for req_id, done in results.items():
        if done.finish_reason == "error":
            assert done.error and "giving up" in done.error
        else:
            assert done.token_ids == expected[req_id], req_id
    assert stats["counters"]["worker_failures"] >= 1 and stats["counters"]["recomputes"] >= 1
    assert stats["live_handoffs"] == 0
    if speculate:
        spec = stats["spec_decode"]
        assert spec["num_drafts"] > 0 and spec["acceptance_rate"] == 1.0


async def restarted(worker, killed: str, timeout_s: float = 60.0):
    """A killed worker's `ready()` once Ray has restarted it: another incarnation than `killed`
    (calls fail while it dies and restarts)."""
    return await wait_for_async(
        lambda ready: ready["incarnation"] != killed,
        timeout_s,
        value=worker.ready.remote,
        errors=(ray.exceptions.RayActorError,),
        poll_s=0.2,
    )


def test_a_decode_worker_restarted_while_idle_is_noticed_before_its_next_step(
    ray_session, tiny_checkpoint
):
    """Kill the decode worker while it has no step in flight but holds the first pieces of a prompt
    still prefilling (imported early into blocks reserved for it): Ray restarts it before the
    scheduler has a failed step to learn from. Its next call must not run on the fresh, empty
    worker as if nothing happened: the scheduler finds out, the pieces are imported again, and
    the request still produces local mode's tokens."""
    config = crowded_config(tiny_checkpoint)
    expected = local_outputs(config, [req("P", 400, 12, 5)])["P"]  # 100 four-token chunks
    gate = Gate.remote()
    engine = start_engine(config, HeldWorker, gate)  # the prompt's last chunk waits at the gate
    stream = streamer(engine.handle)
    decode = ray.get(engine.handle.worker_handles.remote())["decode-0"]
    killed = ray.get(decode.ready.remote())["incarnation"]

    async def scenario():
        task = asyncio.create_task(stream(req("P", 400, 12, 5)))
        # the prompt stops before its last chunk, its first pieces imported: decode-0 idles
        await wait_for_async(lambda n: n == 1, 60, value=gate.waiting.remote)
        await wait_for_stats(engine.handle, lambda s: s["counters"]["early_imports"] >= 2)
        ray.kill(decode, no_restart=False)
        await restarted(decode, killed)
        await gate.open.remote()
        done = await asyncio.wait_for(task, timeout=120)
        return done, await engine.handle.stats.remote()

    try:
        done, stats = asyncio.run(scenario())
    finally:
        engine.close()
    assert done.finish_reason == "length" and done.token_ids == expected
    assert stats["counters"]["worker_failures"] == 1


def test_a_step_that_raises_ends_its_requests_with_the_error_and_the_cell_keeps_serving(
    ray_session, tiny_checkpoint
):
    """A step failing inside the worker (here: a response format only the worker checks) must not
    leave streams waiting forever: the worker's requests end with the error and later requests are
    served."""
    from scheduler.request import SamplingParams

    config = EngineConfig(model=tiny_checkpoint, mode="colocated", slots=2, max_model_len=256)
    with RayEngine(config) as engine:
        bad = make_request("bad", 5, 4)
        bad.sampling = SamplingParams(structured="{not json")
        failed = engine.run([bad])["bad"]
        later = engine.run([req("later", 6, 5)])["later"]
    assert failed.finish_reason == "error" and "internal error on decode-0" in failed.error
    # the client learns what failed and under which id the server logged it, nothing more: no
    # traceback, file paths, hosts or process ids
    assert failed.error.endswith("the server log has the details under bad"), failed.error
    assert "Traceback" not in failed.error and "File " not in failed.error
    assert "pid=" not in failed.error and len(failed.error) < 200
    assert (
        later.finish_reason == "length"
        and later.token_ids == local_outputs(config, [req("later", 6, 5)])["later"]
    )

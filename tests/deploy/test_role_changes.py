"""On Ray, workers moved between the pools while requests run: every output equals local mode's,
and the moved workers serve their new pool."""

import asyncio

import pytest

from deploy.config import EngineConfig
from deploy.driver import RayEngine, open_engine
from deploy.engine_client import EngineClient, complete
from scheduler.request import SamplingParams
from tests.deploy.engine_configs import BASE
from tests.factories import make_requests
from tests.waiting import wait_for_stats

pytestmark = pytest.mark.slow


def workload():
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    lengths = [5, 31, 12, 47, 9, 20, 33, 14, 40, 8, 25, 17]
    outputs = [40, 12, 35, 20, 30, 25, 18, 38, 22, 15, 28, 33]
    return make_requests(12, lengths, outputs, sampling=sampling)


def test_role_changes_under_load_change_no_output(ray_session, tiny_checkpoint):
    with open_engine(EngineConfig(model=tiny_checkpoint, **BASE)) as engine:
        expected = {c.req_id: c.token_ids for c in engine.run(workload()).values()}
    config = EngineConfig(
        model=tiny_checkpoint, mode="disaggregated", prefill_workers=2, decode_workers=2, **BASE
    )
    ray_engine = RayEngine(config)
    handle = ray_engine.handle
    client = EngineClient(handle)

    async def scenario():
        requests = workload()
        tasks = [asyncio.create_task(complete(client, r)) for r in requests[:8]]
        await wait_for_stats(handle, lambda s: s["workers"]["decode-0"]["running"] >= 2)
        # a prefill worker and a decode worker that both hold requests change pools
        moved = [
            await handle.change_role.remote("prefill-1", "decode"),
            await handle.change_role.remote("decode-0", "prefill"),
        ]
        tasks += [asyncio.create_task(complete(client, r)) for r in requests[8:]]
        done = await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)
        # and new work reaches them in their new pools
        more = make_requests(4, [11, 29, 7, 18], [6, 6, 6, 6])
        extra = await asyncio.wait_for(
            asyncio.gather(*(complete(client, r) for r in more)), timeout=120
        )
        return done, extra, moved, await handle.stats.remote()

    try:
        done, extra, moved, stats = asyncio.run(scenario())
        import ray

        ray.get(handle.change_role.remote("prefill-0", "decode"))
        with pytest.raises(Exception, match="the prefill pool keeps one worker"):
            ray.get(handle.change_role.remote("prefill-1", "decode"))
    finally:
        ray_engine.close()
    assert {c.req_id: c.token_ids for c in done} == expected
    assert all(c.error is None for c in done + extra)
    assert [m["actor"] for m in moved] == ["prefill-1", "decode-0"]
    assert stats["pools"]["role_changes"] == 2
    assert (stats["pools"]["prefill"], stats["pools"]["decode"]) == (2, 2)
    assert all(len(c.token_ids) == 6 for c in extra)

"""Handoffs between workers of different tensor-parallel sizes: a prefill worker's piece holds
every KV head (gathered from its ranks), each decode rank imports its own heads; the tokens are
TP-1 local mode's."""

import pytest

from deploy.config import EngineConfig
from deploy.driver import RayEngine, open_engine
from tests.deploy.engine_configs import BASE
from tests.factories import make_requests

# the uneven checkpoint's K and V of one token: 2 layers x K and V x 3 KV heads x 16 fp32 values
ROW_BYTES = 2 * 2 * 3 * 16 * 4


def _requests():
    return make_requests(5, [5, 31, 12, 47, 20], [17, 6, 25, 9, 12])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)], ids=["1P1-1D2", "1P2-1D1", "1P2-1D2"]
)
def test_handoffs_between_tp_sizes_give_local_tp1_tokens(
    ray_session, uneven_checkpoint, prefill_tp, decode_tp
):
    config = dict(BASE | {"model": uneven_checkpoint})
    with open_engine(EngineConfig(**config)) as engine:
        expected = {k: c.token_ids for k, c in engine.run(_requests()).items()}
    pools = EngineConfig(
        **config,
        mode="disaggregated",
        prefill_tensor_parallel_size=prefill_tp,
        decode_tensor_parallel_size=decode_tp,
    )
    with RayEngine(pools) as engine:
        results = engine.run(_requests())
        placement = ray_session.get(engine.handle.ready.remote())
        if prefill_tp != decode_tp:  # a worker keeps its ranks: it cannot join the other pool
            with pytest.raises(Exception, match="keeps its tensor-parallel ranks"):
                ray_session.get(engine.handle.change_role.remote("prefill-0", "decode"))
    assert {k: c.token_ids for k, c in results.items()} == expected
    sizes = sorted(
        p["tensor_parallel_size"]
        for p in placement.values()
        if isinstance(p, dict) and "ranks" in p
    )
    assert sizes == sorted([prefill_tp, decode_tp])
    handed = [r for r in _requests() if results[r.req_id].metrics.get("kv_handoff_bytes")]
    assert handed  # prompts went through a handoff, each with every head of every token
    for request in handed:
        got = results[request.req_id].metrics["kv_handoff_bytes"]
        assert got == len(request.prompt_ids) * ROW_BYTES, request.req_id

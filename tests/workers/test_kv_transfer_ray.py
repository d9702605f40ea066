"""Each transport this machine has moves KV rows between two Ray actors exactly (fp32 and bf16),
a full NIXL staging pool falls back to the object store, and a transport that cannot serve the
cell's workers stops the engine at start with the reason."""

import pytest
import ray
import torch

from deploy.config import EngineConfig
from deploy.driver import RayEngine
from scheduler.messages import KVHandoff, KVImport
from tests.waiting import wait_for
from workers.kv_cache import PagedKVCache
from workers.kv_transfer import KVReceiver, KVSender, make_transport

TABLE_SRC, TABLE_DST = [3, 0, 6], [1, 7, 2]


def filled_cache(dtype, seed):
    kv = PagedKVCache(2, 8, 2, 4, 8, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=generator).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=generator).to(dtype))
    return kv


@ray.remote(num_cpus=0)
class Sender:
    def __init__(self, transport, dtype, staging_bytes):
        self.cache = filled_cache(dtype, seed=7)
        transport = make_transport(transport, torch.device("cpu"), staging_bytes)
        self.sender = KVSender(self.cache, transport)

    def export(self, spans):
        return self.sender.export(spans)

    def rows(self, table, end):
        return self.cache.export_spans([(table, 0, end)])


@ray.remote(num_cpus=0)
class Receiver:
    def __init__(self, dtype):
        self.cache = PagedKVCache(2, 8, 2, 4, 8, dtype=dtype)
        self.receiver = KVReceiver(self.cache)

    def receive(self, imports):
        report = self.receiver.import_all(imports)
        rows = self.cache.export_spans([(TABLE_DST, 0, 11)])
        return report, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("transport", "staging_bytes", "carrier"),
    [("object_store", 0, "object_store"), ("nixl", 1 << 20, "nixl"), ("nixl", 64, "object_store")],
    ids=["object_store", "nixl", "nixl-pool-full"],
)
def test_rows_cross_actors_exactly(ray_session, transport, staging_bytes, carrier, dtype):
    sender = Sender.remote(transport, dtype, staging_bytes)
    receiver = Receiver.remote(dtype)
    # two steps of one prompt: positions 0..5, then 6..10
    pieces = ray.get(sender.export.remote([("a", TABLE_SRC, 0, 6)]))
    pieces += ray.get(sender.export.remote([("a", TABLE_SRC, 6, 11)]))
    assert {piece.transport for piece in pieces} == {carrier}
    imports = [KVImport(TABLE_DST, KVHandoff("a", tuple(pieces), 0))]
    report, rows = ray.get(receiver.receive.remote(imports))
    assert report.failed == [] and report.transfers[carrier].bytes == rows.nbytes
    expected = ray.get(sender.rows.remote(TABLE_SRC, 11))
    assert rows.dtype == dtype
    torch.testing.assert_close(rows, expected, atol=0, rtol=0)


def test_a_transfer_from_a_dead_sender_is_reported_lost(ray_session):
    sender = Sender.remote("nixl", torch.float32, 1 << 20)
    receiver = Receiver.remote(torch.float32)
    pieces = ray.get(sender.export.remote([("a", TABLE_SRC, 0, 11)]))
    ray.kill(sender)
    report, _ = ray.get(
        receiver.receive.remote([KVImport(TABLE_DST, KVHandoff("a", tuple(pieces), 0))])
    )
    assert report.failed == ["a"] and report.transfers["nixl"].failures == 1


def test_a_transport_the_workers_cannot_use_stops_the_engine_at_start(ray_session, tiny_checkpoint):
    config = EngineConfig(
        model=tiny_checkpoint, mode="disaggregated", kv_transport="cuda_ipc", max_model_len=64
    )
    free = ray.available_resources().get("CPU", 0)
    with pytest.raises(ValueError, match="kv_transport cuda_ipc cannot be used: prefill worker 0"):
        RayEngine(config).close()
    # the scheduler and its workers are stopped, not left holding their CPUs
    cpus = wait_for(
        lambda cpus: cpus >= free, 20, value=lambda: ray.available_resources().get("CPU", 0)
    )
    assert cpus == free

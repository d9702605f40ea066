"""The KV transfer seam's contract, with an in-memory transport: rows arrive exactly, a lost,
late or duplicate transfer is reported or harmless, and each pair of workers gets a transport it
can use."""

import time
from typing import get_args

import pytest
import torch

from deploy.config import KVTransport
from scheduler.messages import KVHandoff, KVImport
from workers.kv_cache import PagedKVCache
from workers.kv_transfer import (
    CHOICES,
    KVReceiver,
    KVSender,
    TransferLost,
    choose_transport,
)

LAYERS, HEADS, SIZE, DIM = 2, 2, 4, 8


class FakeTransport:
    """Objects in a dict; a ref can be lost (its get raises) or late (its get sleeps)."""

    def __init__(self, name="fake", batches=True):
        self.name = name
        self.batches = batches
        self.objects: dict[int, torch.Tensor] = {}
        self.lost: set[int] = set()
        self.delay_s: dict[int, float] = {}
        self.gets: list[list[int]] = []

    def put(self, rows):
        ref = len(self.objects)
        self.objects[ref] = rows.clone()
        return ref, self.name

    def get(self, refs, timeout_s):
        self.gets.append(list(refs))
        for ref in refs:
            delay = self.delay_s.get(ref, 0.0)
            if ref in self.lost or delay > timeout_s:
                raise TransferLost(f"object {ref}")
            time.sleep(delay)
        return [self.objects[ref] for ref in refs]

    def prefetch(self, refs):
        pass


def cache(seed=None):
    kv = PagedKVCache(LAYERS, 16, HEADS, SIZE, DIM)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        kv.k.copy_(torch.randn(kv.k.shape, generator=generator))
        kv.v.copy_(torch.randn(kv.v.shape, generator=generator))
    return kv


def rows_at(kv, table, start, end):
    """K and V of positions start..end-1 of a request with `table`, [2, positions, ...]."""
    blocks, offsets = kv.locate(table, start, end)
    return torch.stack([kv.k[:, blocks, :, offsets], kv.v[:, blocks, :, offsets]])


def send(transport, src, exports):
    """A prefill worker's steps: each a list of (req_id, table, first, end); the pieces per
    request."""
    sender = KVSender(src, transport)
    pieces = {}
    for step in exports:
        for piece in sender.export(step):
            pieces.setdefault(piece.req_id, []).append(piece)
    return pieces


def handoff(pieces, req_id, table, held=0):
    return KVImport(table, KVHandoff(req_id, tuple(pieces[req_id]), 0), held=held)


SRC_A, SRC_B = [3, 7, 1], [0, 9]
DST_A, DST_B = [5, 2, 11], [14, 6]


@pytest.mark.parametrize("batches", [True, False], ids=["one-object-per-step", "per-request"])
def test_rows_arrive_exactly_in_the_receivers_blocks(batches):
    src, dst, transport = cache(seed=1), cache(), FakeTransport(batches=batches)
    # two prefill steps: A's first chunk with all of B, then the rest of A
    pieces = send(transport, src, [[("a", SRC_A, 0, 5), ("b", SRC_B, 0, 7)], [("a", SRC_A, 5, 11)]])
    assert len(transport.objects) == (2 if batches else 3)
    report = KVReceiver(dst, {"fake": transport}).import_all(
        [handoff(pieces, "a", DST_A), handoff(pieces, "b", DST_B)]
    )
    assert report.failed == [] and set(report.import_s) == {"a", "b"}
    torch.testing.assert_close(rows_at(dst, DST_A, 0, 11), rows_at(src, SRC_A, 0, 11))
    torch.testing.assert_close(rows_at(dst, DST_B, 0, 7), rows_at(src, SRC_B, 0, 7))
    # each object fetched once, though two requests' pieces share the first step's
    assert sorted(ref for refs in transport.gets for ref in refs) == list(transport.objects)
    counts = report.transfers["fake"]
    expected = sum(t.nbytes for t in transport.objects.values())
    assert counts.bytes == expected and counts.failures == 0


def test_positions_the_receiver_holds_are_not_written():
    src, dst, transport = cache(seed=2), cache(seed=3), FakeTransport()
    pieces = send(transport, src, [[("a", SRC_A, 0, 6)], [("a", SRC_A, 6, 11)]])
    before = rows_at(dst, DST_A, 0, 4).clone()
    KVReceiver(dst, {"fake": transport}).import_all([handoff(pieces, "a", DST_A, held=4)])
    torch.testing.assert_close(rows_at(dst, DST_A, 0, 4), before)  # its cached prefix
    torch.testing.assert_close(rows_at(dst, DST_A, 4, 11), rows_at(src, SRC_A, 4, 11))


def test_a_lost_transfer_fails_its_request_alone():
    src, dst, transport = cache(seed=4), cache(), FakeTransport(batches=False)
    pieces = send(transport, src, [[("a", SRC_A, 0, 5), ("b", SRC_B, 0, 7)]])
    transport.lost.add(pieces["a"][0].ref)
    before = rows_at(dst, DST_A, 0, 5).clone()
    report = KVReceiver(dst, {"fake": transport}).import_all(
        [handoff(pieces, "a", DST_A), handoff(pieces, "b", DST_B)]
    )
    assert report.failed == ["a"] and set(report.import_s) == {"b"}
    assert report.transfers["fake"].failures == 1
    torch.testing.assert_close(rows_at(dst, DST_A, 0, 5), before)  # nothing of A written
    torch.testing.assert_close(rows_at(dst, DST_B, 0, 7), rows_at(src, SRC_B, 0, 7))


def test_a_late_transfer_arrives_whole_and_one_past_the_timeout_is_lost():
    src, transport = cache(seed=5), FakeTransport(batches=False)
    pieces = send(transport, src, [[("a", SRC_A, 0, 5), ("b", SRC_B, 0, 7)]])
    transport.delay_s = {pieces["a"][0].ref: 0.2, pieces["b"][0].ref: 5.0}
    dst = cache()
    report = KVReceiver(dst, {"fake": transport}, timeout_s=1.0).import_all(
        [handoff(pieces, "a", DST_A), handoff(pieces, "b", DST_B)]
    )
    assert report.failed == ["b"] and report.import_s["a"] >= 0.2
    assert report.transfers["fake"].seconds >= 0.2
    torch.testing.assert_close(rows_at(dst, DST_A, 0, 5), rows_at(src, SRC_A, 0, 5))


def test_a_duplicate_transfer_changes_nothing():
    src, transport = cache(seed=6), FakeTransport()
    pieces = send(transport, src, [[("a", SRC_A, 0, 5)], [("a", SRC_A, 5, 11)]])
    once, twice = cache(), cache()
    KVReceiver(once, {"fake": transport}).import_all([handoff(pieces, "a", DST_A)])
    receiver = KVReceiver(twice, {"fake": transport})
    receiver.import_all([handoff(pieces, "a", DST_A), handoff(pieces, "a", DST_A)])
    receiver.import_all([handoff(pieces, "a", DST_A)])  # sent again by a later step
    torch.testing.assert_close(twice.k, once.k, atol=0, rtol=0)
    torch.testing.assert_close(twice.v, once.v, atol=0, rtol=0)


def test_bf16_rows_travel_as_16_bit_words_and_arrive_exactly():
    src = PagedKVCache(LAYERS, 16, HEADS, SIZE, DIM, dtype=torch.bfloat16)
    src.k.copy_(torch.randn(src.k.shape))
    src.v.copy_(torch.randn(src.v.shape))
    dst = PagedKVCache(LAYERS, 16, HEADS, SIZE, DIM, dtype=torch.bfloat16)
    words = src.export_spans([(SRC_A, 0, 9)]).view(torch.int16)  # as the object store has them
    dst.import_rows(DST_A, words.numpy())
    torch.testing.assert_close(rows_at(dst, DST_A, 0, 9), rows_at(src, SRC_A, 0, 9), atol=0, rtol=0)


# ---- which transport a prefill worker uses


def worker(index, device="cpu", node="n1", gpus=(), **transports):
    usable = {"object_store": "", "cuda_ipc": "" if device == "cuda" else "device is cpu"}
    return {
        "index": index,
        "device": device,
        "node_id": node,
        "gpu_ids": list(gpus),
        "transports": usable | transports,
    }


def test_auto_picks_the_fastest_transport_every_pair_can_use():
    cpu = worker(0, nixl="")
    assert choose_transport("auto", cpu, [worker(1, nixl="")]) == "object_store"
    prefill = worker(0, "cuda", gpus=["0"], nixl="")
    shared = worker(1, "cuda", gpus=["0"], nixl="")
    other_gpu = worker(2, "cuda", gpus=["1"], nixl="")
    other_node = worker(3, "cuda", node="n2", gpus=["0"], nixl="")
    assert choose_transport("auto", prefill, [shared]) == "cuda_ipc"
    assert choose_transport("auto", prefill, [shared, other_gpu]) == "nixl"
    assert choose_transport("auto", prefill, [other_node]) == "nixl"
    no_nixl = worker(4, "cuda", node="n2", gpus=["0"], nixl="NIXL is not installed")
    assert choose_transport("auto", prefill, [other_node, no_nixl]) == "object_store"


def test_a_transport_some_pair_cannot_use_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="cuda_ipc cannot be used: prefill worker 0: device"):
        choose_transport("cuda_ipc", worker(0), [worker(1)])
    gpu = worker(0, "cuda", gpus=["0"])
    with pytest.raises(ValueError, match="decode worker 2 is not on prefill worker 0's GPU"):
        choose_transport("cuda_ipc", gpu, [worker(1, "cuda", gpus=["0"]), worker(2, "cuda")])
    missing = worker(1, nixl="NIXL is not installed (no module)")
    with pytest.raises(ValueError, match="decode worker 1: NIXL is not installed"):
        choose_transport("nixl", worker(0, nixl=""), [missing])
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        choose_transport("rdma", worker(0), [worker(1)])
    assert choose_transport("nixl", worker(0, nixl=""), [worker(1, nixl="")]) == "nixl"
    assert choose_transport("object_store", gpu, [worker(1, "cuda")]) == "object_store"


def test_the_config_offers_the_seams_choices():
    assert get_args(KVTransport) == CHOICES

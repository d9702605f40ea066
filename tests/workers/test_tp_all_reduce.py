"""The shared-memory all-reduce of a tensor-parallel group (two spawned gloo ranks, one thread
each): every rank holds torch.distributed's sum, bit for bit; what does not fit its slots, or is
not fp32 or bf16, goes through torch.distributed; a rank that died is reported, not waited for."""

import pytest
import torch

from tests.workers.tp_ranks import run_ranks
from workers import kernels

pytestmark = pytest.mark.skipif(kernels.load_kernels() is None, reason="no CPU kernels here")


def _group(rank: int, size: int):
    from workers.tp import TensorParallel
    from workers.tp_split import rank_shard

    return TensorParallel(rank_shard(4, 2, 128, 384, size, rank))


def _sums(rank: int, size: int) -> dict:
    import torch.distributed as dist

    from workers.tp import SHM_SLOT_BYTES

    tp = _group(rank, size)
    g = torch.Generator().manual_seed(rank)
    wide = torch.randn(64, 8, generator=g)
    cases = {
        "decode rows": torch.randn(16, 576, generator=g),
        "bf16": torch.randn(3, 64, generator=g).bfloat16(),
        "a column (not contiguous)": wide[:, 2],
        "past the slots": torch.randn(SHM_SLOT_BYTES // 4 + 1, generator=g),
        "int64": torch.arange(5) * (rank + 1),
    }
    results = {}
    for name, x in cases.items():
        expected = x.clone()
        dist.all_reduce(expected)
        before = tp.num_reduces
        tp.all_reduce(x)
        results[name] = (x.clone(), expected, tp.num_reduces - before)
    assert torch.equal(wide[:, 2], results["a column (not contiguous)"][0])  # summed in place
    return results


def test_every_rank_holds_the_sum_of_torch_distributed(tmp_path):
    ranks = run_ranks(_sums, 2, tmp_path)
    shared = {"decode rows", "bf16", "a column (not contiguous)"}
    for name, (got, expected, num_shared) in ranks[0].items():
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
        assert torch.equal(got, ranks[1][name][0]), name  # the same bits on every rank
        assert num_shared == (1 if name in shared else 0), name


def _rank_one_leaves(rank: int, size: int) -> str | None:
    import os
    import signal
    import time

    tp = _group(rank, size)
    tp.all_reduce(torch.ones(4))  # both map the region
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 .*is gone"):
        tp.all_reduce(torch.ones(4))
    return f"noticed in {time.monotonic() - start:.1f} s"


def test_a_rank_that_died_is_reported_not_waited_for(tmp_path):
    noticed = run_ranks(_rank_one_leaves, 2, tmp_path, timeout=60, killed_ok=True)[0]
    assert noticed.startswith("noticed")

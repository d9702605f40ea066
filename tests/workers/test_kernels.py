"""The compiled CPU kernels against the torch ops they replace: ragged tails, biases, empty batches,
bf16 rounding, paged decode and prompt attention over shuffled and shared blocks."""

import itertools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.factories import prompt_ids, tiny_model
from tests.workers.paged_cases import (
    BLOCK,
    CHUNKS,
    LENGTHS,
    TOLERANCE,
    PagedCase,
    paged_cases,
    prompt_chunks,
)
from workers import kernels
from workers.kv_cache import PagedKVCache
from workers.model import BatchLayout, RMSNorm


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 7, 13, 50])
@pytest.mark.parametrize(
    ("out_features", "in_features", "bias"), [(64, 48, False), (100, 48, True), (200, 37, False)]
)
def test_packed_linear_matches_f_linear_and_repacks_after_a_write(
    rows, out_features, in_features, bias, dtype, monkeypatch
):
    monkeypatch.setattr(kernels, "LIBRARY_BF16_ON_AMX", False)  # the packed kernel, even there
    if not kernels.load_kernels().packed_linear_available(dtype == torch.bfloat16):
        pytest.skip("no packed matmul for this dtype on this CPU: F.linear does the work")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).to(dtype)  # [M, K]
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)  # [N, K]
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None  # [N]
    tolerance = TOLERANCE[dtype]
    with torch.inference_mode():
        torch.testing.assert_close(
            kernels.linear(x, weight, b), F.linear(x, weight, b), **tolerance
        )
        weight[3] = 0.0  # a state dict loaded into the weight: the packed copy must follow
        torch.testing.assert_close(
            kernels.linear(x, weight, b), F.linear(x, weight, b), **tolerance
        )
        made_in_inference_mode = weight.clone()  # has no version counter
        torch.testing.assert_close(
            kernels.linear(x, made_in_inference_mode, b), F.linear(x, weight, b), **tolerance
        )


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels_match_the_eager_ops(dtype, monkeypatch):
    """bf16 rounds after every op as torch does, so it matches bit for bit; fp32 within a few
    ulp."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, rows = 4, 2, 16, 9
    norm = RMSNorm(40, eps=1e-6).to(dtype)
    norm.weight.data = torch.rand(40, generator=g).to(dtype)
    x, delta = (
        torch.randn(rows, 40, generator=g).to(dtype),
        torch.randn(rows, 40, generator=g).to(dtype),
    )
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    angle = torch.rand(rows, 1, dim, generator=g) * 6  # [N, 1, D]
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slots, positions = torch.arange(rows) % 3, torch.arange(rows) * 2 + 1
    gate_up = torch.randn(rows, 2 * 24, generator=g).to(dtype) * 4

    def run():
        caches = torch.zeros(2, 3, kv_heads, 32, dim, dtype=dtype)  # K and V: [S, KVH, C, D] each
        residual = x.clone()
        normed = kernels.add_rms_norm(residual, delta, norm)
        q = kernels.rope_and_cache(qkv, cos, sin, heads, caches[0], caches[1], slots, positions)
        return residual, normed, q, caches, kernels.silu_mul(gate_up)

    fused = run()
    monkeypatch.setattr(kernels, "load_kernels", lambda: None)
    eager = run()
    exact = dtype == torch.bfloat16
    for got, want in zip(fused, eager, strict=True):
        torch.testing.assert_close(got, want, atol=0 if exact else 1e-5, rtol=0 if exact else 1e-5)


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_rows_logits_do_not_depend_on_its_batch(dtype, monkeypatch):
    """Each kernel computes a row alone, in an order that does not depend on the number of rows (the
    packed matmul sums k in order for any M), so batched decode rows equal solo ones bit for bit
    (with the packed matmul: bf16 on AMX CPUs takes oneDNN's by default)."""
    monkeypatch.setattr(kernels, "LIBRARY_BF16_ON_AMX", False)
    if not kernels.load_kernels().packed_linear_available(dtype == torch.bfloat16):
        pytest.skip(
            "no packed matmul for this dtype on this CPU: the library matmul may block by batch "
            "size"
        )
    model = tiny_model("llama").to(dtype)
    spec = model.spec
    cache = PagedKVCache(spec.num_layers, 32, spec.num_kv_heads, BLOCK, spec.head_dim, dtype=dtype)
    prompts = [prompt_ids(10 + 9 * i, seed=i) for i in range(6)]
    # each request's blocks (1 to 4 of them: ragged tables) taken from a shuffled pool
    free = torch.randperm(32, generator=torch.Generator().manual_seed(0)).tolist()
    tables = []
    for prompt in prompts:
        tables.append([free.pop() for _ in range(-(-len(prompt) // BLOCK))])
        ids, layout = BatchLayout.pack([(tables[-1], prompt[:-1], 0)], 0, BLOCK, "cpu")
        model(ids, layout, cache, torch.tensor([0]))
    rows = [
        (table, [prompt[-1]], len(prompt) - 1)
        for table, prompt in zip(tables, prompts, strict=True)
    ]
    ids, layout = BatchLayout.pack(rows, len(rows), BLOCK, "cpu")
    batched = model(ids, layout, cache, torch.arange(len(rows)))  # [6, vocab]
    for i, row in enumerate(rows):
        ids, layout = BatchLayout.pack([row], 1, BLOCK, "cpu")
        assert torch.equal(model(ids, layout, cache, torch.tensor([0]))[0], batched[i])


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize(("dtype", "heads_per_kv", "dim"), paged_cases())
def test_paged_decode_attention_is_bit_for_bit_the_contiguous_one(dtype, heads_per_kv, dim):
    """Where a row's blocks lie, which rows share them and the block size change nothing: the sums
    run over t in the same order. And a row's result does not depend on the rest of its batch."""
    case = PagedCase(dtype, heads_per_kv, dim)
    q, lengths = case.query, case.lengths
    shuffled = kernels.decode_attention(q, *case.shuffled, lengths)  # [B, KVH, G, D]
    assert torch.equal(shuffled, kernels.decode_attention(q, *case.identity, lengths))
    assert torch.equal(shuffled, kernels.decode_attention(q, *case.slot, lengths))
    k_pool, v_pool, tables = case.shuffled
    for row in range(len(LENGTHS)):
        solo = kernels.decode_attention(
            q[row : row + 1], k_pool, v_pool, tables[row : row + 1], lengths[row : row + 1]
        )  # [1, KVH, G, D]
        assert torch.equal(solo[0], shuffled[row])


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize(("dtype", "heads_per_kv", "dim"), paged_cases())
def test_paged_decode_attention_matches_a_float64_softmax(dtype, heads_per_kv, dim):
    case = PagedCase(dtype, heads_per_kv, dim)
    got = kernels.decode_attention(case.query, *case.shuffled, case.lengths)  # [B, KVH, G, D]
    torch.testing.assert_close(got, case.reference().to(dtype), **TOLERANCE[dtype])


def _huge_page_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages here",
)
def test_a_kv_pool_lies_on_huge_pages_where_linux_has_them():
    """A decode row reads its keys a block at a time from anywhere in the pool: on 4 KiB pages
    nearly every block is a TLB miss. The pool's pages are taken as it is written, as a worker's
    KV is."""
    for dtype, blocks in ((torch.float32, 128), (torch.bfloat16, 256)):
        cache = PagedKVCache(2, blocks, 2, BLOCK, 64, dtype=dtype)  # 2 MiB a pool
        for pool in (cache.k, cache.v):
            assert pool.shape == (2, blocks, 2, BLOCK, 64) and pool.dtype == dtype
            assert pool.data_ptr() % (2 << 20) == 0
            pool.fill_(1.0)  # (a read first would map the zero page, which stays small)
            assert _huge_page_kib(pool.data_ptr()) >= 2048
        fresh = PagedKVCache(2, blocks, 2, BLOCK, 64, dtype=dtype)
        assert not fresh.k.any() and not fresh.v.any()


@pytest.mark.parametrize(("dtype", "heads_per_kv", "dim"), paged_cases())
def test_paged_decode_attention_in_torch_ops_matches_a_float64_softmax(dtype, heads_per_kv, dim):
    """The fallback where the kernel does not apply (no compiler, CUDA): no compiler needed here."""
    case = PagedCase(dtype, heads_per_kv, dim)
    # [B, KVH, G, D]
    got = kernels.paged_decode_attention_torch(case.query, *case.shuffled, case.lengths)
    assert got.is_contiguous()
    torch.testing.assert_close(got, case.reference().to(dtype), **TOLERANCE[dtype])


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize(("dtype", "heads_per_kv", "dim"), paged_cases())
def test_paged_prompt_attention_matches_a_float64_causal_softmax(dtype, heads_per_kv, dim):
    """Every chunk of the call over its own shuffled (and shared) blocks, each token seeing the
    keys up to its position; what the pool holds past them is NaN, so a stray read shows."""
    case = PagedCase(dtype, heads_per_kv, dim)
    query, starts, firsts, counts = prompt_chunks(case, CHUNKS)
    got = kernels.prompt_attention(query, *case.shuffled, starts, firsts, counts)
    assert got is not None  # [N, KVH, G, D]
    for row, (start, n) in enumerate(CHUNKS):
        first = int(firsts[row])
        for i in range(n):
            q = query[first + i].double()  # [KVH, G, D]
            k, v = case.keys[:, row, :, : start + i + 1].double()  # [KVH, keys, D] each
            weights = torch.softmax(q @ k.transpose(1, 2) * dim**-0.5, dim=-1)
            want = (weights @ v).to(dtype)  # [KVH, G, D]
            torch.testing.assert_close(got[first + i], want, **TOLERANCE[dtype])


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_tokens_attention_does_not_depend_on_its_chunks_or_their_batch(dtype):
    """A token's sums run over its keys in position order whatever chunk it came in, and whatever
    else the call holds: a prompt prefilled in one chunk or in three, alone or beside others, gives
    the same bits (and so does a cached prefix plus the rest)."""
    case = PagedCase(dtype, 3, 64)
    query, starts, firsts, counts = prompt_chunks(case, CHUNKS)
    together = kernels.prompt_attention(query, *case.shuffled, starts, firsts, counts)
    k_pool, v_pool, tables = case.shuffled
    whole = query[:37]  # row 0's prompt: [37, KVH, G, D]
    for cuts in ([0, 37], [0, 5, 21, 37], [0, 16, 17, 37]):
        parts = []
        for a, b in itertools.pairwise(cuts):
            out = kernels.prompt_attention(
                whole[a:b].contiguous(),
                k_pool,
                v_pool,
                tables[:1],
                torch.tensor([a]),
                torch.tensor([0]),
                torch.tensor([b - a]),
            )
            parts.append(out)
        assert torch.equal(torch.cat(parts), together[:37])


def test_the_kernel_path_returns_none_where_it_does_not_apply(monkeypatch):
    """Another dtype (or device, or no compiler): None, and the caller runs the torch ops."""
    case = PagedCase(torch.float32, 1, 16)
    query = case.query.double()  # [B, KVH, G, D]
    k_pool, v_pool, tables = case.shuffled
    assert (
        kernels.decode_attention(query, k_pool.double(), v_pool.double(), tables, case.lengths)
        is None
    )
    query, starts, firsts, counts = prompt_chunks(case, CHUNKS)
    as_double = (query.double(), k_pool.double(), v_pool.double(), tables)
    assert kernels.prompt_attention(*as_double, starts, firsts, counts) is None
    monkeypatch.setattr(kernels, "load_kernels", lambda: None)
    assert kernels.decode_attention(case.query, *case.shuffled, case.lengths) is None
    assert kernels.prompt_attention(query, *case.shuffled, starts, firsts, counts) is None


@pytest.mark.usefixtures("compiled")
def test_bf16_matmuls_take_onednns_amx_tiles_where_the_cpu_has_them():
    module = kernels.load_kernels()
    x = torch.randn(8, 64).to(torch.bfloat16)
    weight = torch.randn(32, 64).to(torch.bfloat16)
    with torch.inference_mode():
        kernels.linear(x, weight)
    # the packed copy is made only where the packed kernel does the work
    packed = hasattr(weight, "_pdserve_packed")
    assert packed == (module.packed_linear_available(True) and not module.amx_bf16())


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("rows", [1, 7, 64, 130, 300])
@pytest.mark.parametrize(
    ("out_features", "in_features", "bias"), [(96, 64, True), (200, 38, False)]
)
def test_bf16_on_amx_multiplies_by_a_weight_reordered_once_and_again_after_a_write(
    rows, out_features, in_features, bias
):
    if not kernels.load_kernels().amx_bf16():
        pytest.skip("no AMX on this CPU: bf16 takes the packed kernel or F.linear")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)  # [M, K]
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)  # [N, K]
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None  # [N]
    tolerance = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(kernels.linear(x, weight, b), F.linear(x, weight, b), **tolerance)
    assert weight._pdserve_onednn[1] is not None  # reordered once, kept beside the weight
    weight[3] = 0.0  # a state dict loaded into the weight: the reordered copy must follow
    torch.testing.assert_close(kernels.linear(x, weight, b), F.linear(x, weight, b), **tolerance)
    # a strided input (a view of a wider activation) multiplies as its contiguous copy does
    wide = torch.randn(rows, 2 * in_features, generator=g).to(torch.bfloat16)[:, :in_features]
    torch.testing.assert_close(kernels.linear(wide, weight), F.linear(wide, weight), **tolerance)

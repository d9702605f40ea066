"""Attention over an 8-bit KV cache (int8, fp8) against attention over the same cache dequantized:
decode rows and prompt chunks over shuffled and shared blocks, lengths ending mid-block, GQA groups
of 1 to 7, fp32 and bf16 queries; the C++ kernels, the torch ops and the kernels' AVX2 build.

Tolerance: the kernels compute the fp32 sums of the full-precision kernels over the dequantized
values (a key's scale multiplies its dot product, a value's scale its softmax weight), so they
differ from a float64 softmax over the dequantized cache by fp32 rounding alone: the full-precision
tests' tolerances hold (1e-5 for fp32 outputs, about an ulp for bf16 ones). The torch ops
dequantize into the query's dtype (bf16 rounds each value) and sum in SDPA's order, within the
same tolerances."""

import itertools

import pytest
import torch

from tests.workers.paged_cases import (
    CHUNKS,
    LENGTHS,
    TOLERANCE,
    Kv8Case,
    paged_cases,
    prompt_chunks,
)
from workers import kernels
from workers.kv_quant import STORAGE


def kv8_cases():
    for kind in STORAGE:
        for case in paged_cases():
            dtype, heads_per_kv, dim = case.values
            yield pytest.param(kind, dtype, heads_per_kv, dim, id=f"{kind}-{case.id}")


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize(("kind", "dtype", "heads_per_kv", "dim"), kv8_cases())
def test_decode_attention_over_an_8bit_cache_matches_the_dequantized_cache(
    kind, dtype, heads_per_kv, dim
):
    """The kernel and the torch ops both match the dequantized cache's attention, and each other;
    a row's result does not depend on the rest of its batch (bit for bit)."""
    case = Kv8Case(kind, dtype, heads_per_kv, dim)
    q, lengths = case.query, case.lengths
    want = case.reference().to(dtype)  # [B, KVH, G, D]
    got = kernels.decode_attention(q, *case.shuffled, lengths, case.scales)  # [B, KVH, G, D]
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    in_torch = kernels.paged_decode_attention_torch(q, *case.shuffled, lengths, case.scales)
    torch.testing.assert_close(in_torch, want, **TOLERANCE[dtype])
    torch.testing.assert_close(got, in_torch, **TOLERANCE[dtype])
    k_pool, v_pool, tables = case.shuffled
    for row in range(len(LENGTHS)):
        solo = kernels.decode_attention(
            q[row : row + 1],
            k_pool,
            v_pool,
            tables[row : row + 1],
            lengths[row : row + 1],
            case.scales,
        )  # [1, KVH, G, D]
        assert torch.equal(solo[0], got[row])


def prompt_reference(case: Kv8Case, query: torch.Tensor, firsts: torch.Tensor) -> torch.Tensor:
    """Each chunk token's causal attention over the dequantized keys, in float64: `[N, KVH, G,
    D]` in the query's dtype."""
    out = torch.empty_like(query)
    dim = query.shape[-1]
    for row, (start, n) in enumerate(CHUNKS):
        first = int(firsts[row])
        for i in range(n):
            q = query[first + i].double()  # [KVH, G, D]
            k, v = case.keys[:, row, :, : start + i + 1]  # [KVH, keys, D] each
            weights = torch.softmax(q @ k.transpose(1, 2) * dim**-0.5, dim=-1)
            out[first + i] = (weights @ v).to(query.dtype)  # [KVH, G, D]
    return out


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize(("kind", "dtype", "heads_per_kv", "dim"), kv8_cases())
def test_prompt_attention_over_an_8bit_cache_matches_the_dequantized_cache(
    kind, dtype, heads_per_kv, dim
):
    case = Kv8Case(kind, dtype, heads_per_kv, dim)
    query, starts, firsts, counts = prompt_chunks(case, CHUNKS)
    got = kernels.prompt_attention(query, *case.shuffled, starts, firsts, counts, case.scales)
    assert got is not None  # [N, KVH, G, D]
    torch.testing.assert_close(got, prompt_reference(case, query, firsts), **TOLERANCE[dtype])


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("kind", list(STORAGE))
def test_a_prompt_tokens_attention_over_an_8bit_cache_does_not_depend_on_its_chunks(kind):
    """As at full precision: one chunk or three, the same bits (a token's sums run over its keys
    in position order, each key's scale applied to its own score)."""
    case = Kv8Case(kind, torch.float32, 3, 64)
    query, starts, firsts, counts = prompt_chunks(case, CHUNKS)
    together = kernels.prompt_attention(query, *case.shuffled, starts, firsts, counts, case.scales)
    k_pool, v_pool, tables = case.shuffled
    whole = query[:37]  # row 0's prompt: [37, KVH, G, D]
    for cuts in ([0, 5, 21, 37], [0, 16, 17, 37]):
        parts = [
            kernels.prompt_attention(
                whole[a:b].contiguous(),
                k_pool,
                v_pool,
                tables[:1],
                torch.tensor([a]),
                torch.tensor([0]),
                torch.tensor([b - a]),
                case.scales,
            )
            for a, b in itertools.pairwise(cuts)
        ]
        assert torch.equal(torch.cat(parts), together[:37])


def avx2_build():
    """The kernels built again without AVX-512 (the plain and AVX2 paths a CPU without it runs),
    kept in torch's extension cache as their own module; None where this CPU has no AVX-512 (the
    main build is that build already) or no compiler."""
    module = kernels.load_kernels()
    if module is None:
        return None
    with open("/proc/cpuinfo") as f:
        if " avx512f" not in f.read():
            return None
    name = f"pdserve_kernels_noavx512_{kernels._machine_tag()}"
    return kernels.build(name=name, cflags=["-mno-avx512f"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STORAGE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_reads_and_writes_an_8bit_cache_as_the_avx512_one(kind, dtype):
    """On an AVX-512 CPU, the paths other CPUs run: attention matches the dequantized cache (a head
    dim the AVX-512 decode loop takes, 64, and one it does not, 24), and the cache write gives the
    same bytes."""
    avx2 = avx2_build()
    if avx2 is None:
        pytest.skip("no AVX-512 here: the main build is the AVX2 one, tested above")
    for dim in (64, 24):
        case = Kv8Case(kind, dtype, 3, dim)
        k_pool, v_pool, tables = case.shuffled
        pools = (k_pool, v_pool, *case.scales)
        scale = dim**-0.5
        got = avx2.decode_attention_kv8(case.query, *pools, tables, case.lengths, scale)
        torch.testing.assert_close(got, case.reference().to(dtype), **TOLERANCE[dtype])
        query, starts, firsts, counts = prompt_chunks(case, CHUNKS)
        got = avx2.prompt_attention_kv8(query, *pools, tables, starts, firsts, counts, scale)
        want = prompt_reference(case, query, firsts)
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(9, 8, 64, generator=g) * 3).to(dtype)  # [N, H + 2 KVH, D]: 4, 2, 2
    angle = torch.rand(9, 1, 64, generator=g) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slots, positions = torch.arange(9) % 3, torch.arange(9)  # [N] each
    written = []
    for module in (kernels.load_kernels(), avx2):
        caches = torch.zeros(2, 3, 2, 16, 64, dtype=STORAGE[kind])  # [2, S, KVH, C, D]
        scales = torch.zeros(2, 3, 2, 16, dtype=torch.float16)
        q = module.rope_and_cache_kv8(
            qkv, cos, sin, caches[0], caches[1], scales[0], scales[1], slots, positions, 4
        )
        written.append((q, caches, scales))
    for a, b in zip(*written, strict=True):
        assert torch.equal(a, b)

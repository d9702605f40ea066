"""The compiled CPU kernels against the torch ops they replace: ragged tails, biases, empty batches,
bf16 rounding."""

import pytest
import torch
import torch.nn.functional as F

from tests.factories import prompt_ids, tiny_model
from workers import kernels
from workers.kv_cache import SlotKVCache
from workers.model import BatchLayout, RMSNorm


@pytest.fixture(autouse=True)
def compiled():
    if kernels.load_kernels() is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 7, 13, 50])
@pytest.mark.parametrize(
    ("out_features", "in_features", "bias"), [(64, 48, False), (100, 48, True), (200, 37, False)]
)
def test_packed_linear_matches_f_linear_and_repacks_after_a_write(
    rows, out_features, in_features, bias, dtype
):
    if not kernels.load_kernels().packed_linear_available(dtype == torch.bfloat16):
        pytest.skip("no packed matmul for this dtype on this CPU: F.linear does the work")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).to(dtype)  # [M, K]
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)  # [N, K]
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None  # [N]
    # bf16: the same fp32 sums in another order, rounded once to bf16: at most an ulp of bf16 apart
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.01}
    )
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_rows_logits_do_not_depend_on_its_batch(dtype):
    """Each kernel computes a row alone, in an order that does not depend on the number of rows (the
    packed matmul sums k in order for any M), so batched decode rows equal solo ones bit for bit."""
    if not kernels.load_kernels().packed_linear_available(dtype == torch.bfloat16):
        pytest.skip(
            "no packed matmul for this dtype on this CPU: the library matmul may block by batch "
            "size"
        )
    model = tiny_model("llama").to(dtype)
    spec = model.spec
    cache = SlotKVCache(spec.num_layers, 6, spec.num_kv_heads, 128, spec.head_dim, dtype=dtype)
    prompts = [prompt_ids(10 + 9 * slot, seed=slot) for slot in range(6)]
    for slot, prompt in enumerate(prompts):
        ids, layout = BatchLayout.pack([(slot, prompt[:-1], 0)], 0, "cpu")
        model(ids, layout, cache, torch.tensor([0]))
    rows = [(slot, [prompt[-1]], len(prompt) - 1) for slot, prompt in enumerate(prompts)]
    ids, layout = BatchLayout.pack(rows, len(rows), "cpu")
    batched = model(ids, layout, cache, torch.arange(len(rows)))  # [6, vocab]
    for i, row in enumerate(rows):
        ids, layout = BatchLayout.pack([row], 1, "cpu")
        assert torch.equal(model(ids, layout, cache, torch.tensor([0]))[0], batched[i])

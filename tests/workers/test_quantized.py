"""Packed quantized weights: the kernel against the dequantized reference, GGUF blocks read bit for
bit and under our names, q and k rows in transformers' order, a tiny model served packed."""

import gguf
import pytest
import torch
import torch.nn.functional as F

from tests.factories import gguf_quantize, prompt_ids, save_tiny_gguf, tiny_hf_model, tiny_model
from tests.workers.quant_cases import (
    FORMATS,
    int8_activations,
    logits,
    matmul_cases,
    packed,
    relative_error,
    shapes,
)
from workers.gguf_blocks import gguf_weights, read_quants, unpermute_rows
from workers.loader import pack_weights
from workers.quantized import PackedWeight, install, weight_bytes


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize(("fmt", "n", "k"), matmul_cases())
def test_the_packed_matmul_is_the_dequantized_one_up_to_its_int8_activations(fmt, n, k, rows):
    """The bound: the kernel rounds x_k to d_b q_k with d_b = amax_b / 127 (amax_b the largest |x|
    of x_k's block b of 32), so |x_k - d_b q_k| <= amax_b / 254, and takes each block's dot
    product in exact integers; hence |y_n - ref_n| <= sum_b amax_b / 254 * sum_{k in b} |w_nk|,
    plus fp32's rounding of the sums. Tighter: it equals the product of those rounded activations
    up to fp32 sums."""
    weight = packed(fmt, n, k)
    g = torch.Generator().manual_seed(1)
    # activations of mixed scales, as a model's are (a few large ones in a block)
    x = torch.randn(rows, k, generator=g) * torch.randn(rows, k, generator=g).exp()
    bias = torch.randn(n, generator=g)
    y = weight.linear(x, bias).double()  # [M, N]
    w = weight.dequantize().double()  # [N, K]
    reference = F.linear(x.double(), w, bias.double())
    amax = x.view(rows, -1, 32).abs().amax(dim=2).double()  # [M, KB]
    block_weights = w.abs().view(n, -1, 32).sum(dim=2)  # [N, KB]
    bound = amax @ block_weights.T / 254  # [M, N]
    fp32_sums = 1e-5 * (x.abs().double() @ w.abs().T + bias.abs().double())
    assert ((y - reference).abs() <= bound + fp32_sums).all()
    rounded = int8_activations(x)
    exact = F.linear(rounded, w, bias.double())
    assert ((y - exact).abs() <= 1e-5 * (rounded.abs() @ w.abs().T + bias.abs().double())).all()


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_is_computed_alone_and_bf16_rounds_the_fp32_result_once(fmt):
    """A row's output does not depend on the rows beside it (so a request's tokens do not depend on
    its batch), and bf16 activations give the fp32 kernel's result on the same values, rounded."""
    n, k = shapes(fmt)[0]
    weight = packed(fmt, n, k)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(2))
    batched = weight.linear(x)
    for i in range(13):
        assert torch.equal(weight.linear(x[i : i + 1])[0], batched[i])
    bias = torch.randn(n).bfloat16()
    x16 = x.bfloat16()
    rounded = weight.linear(x16.float(), bias.float()).bfloat16()
    assert torch.equal(weight.linear(x16, bias), rounded)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_blocks_dequantize_bit_for_bit_as_gguf_does(fmt):
    """Packed and unpacked again, the quants give `gguf.quants.dequantize`'s values exactly, whole
    or a few rows at a time (an embedding lookup). The K-quants also from random bytes: every
    6-bit scale and min, every sign of Q6_K's scales (d and dmin made small finite fp16s)."""
    qtype = gguf.GGMLQuantizationType[fmt]
    k = 512 if fmt.endswith("_K") else 96
    g = torch.Generator().manual_seed(3)
    w = torch.randn(33, k, generator=g).numpy()
    raw = gguf_quantize(w, fmt)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert (reference - w).abs().max() < 0.2 * abs(w).max()  # blocks of these values
    if fmt.endswith("_K"):
        noise = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g).numpy()
        supers = noise.reshape(33, k // 256, -1)
        for first in [0, 2] if fmt == "Q4_K" else [208]:
            small = (torch.rand(33, k // 256, generator=g) / 50).half().numpy()
            supers[:, :, first : first + 2] = small.view("uint8").reshape(33, k // 256, 2)
        noisy = PackedWeight.pack(read_quants("w", fmt, torch.from_numpy(noise), k))
        assert torch.equal(
            noisy.dequantize(), torch.from_numpy(gguf.quants.dequantize(noise, qtype))
        )
    weight = PackedWeight.pack(read_quants("w", fmt, torch.from_numpy(raw), k))
    assert torch.equal(weight.dequantize(), reference)
    ids = torch.tensor([[32, 0], [17, 17]])
    assert torch.equal(weight.rows(ids), reference[ids])


def test_concatenated_weights_keep_their_rows_and_share_whole_panels():
    """A fused projection is its parts' rows in order; parts of whole panels become views of it
    (nothing stored twice), others are repacked."""
    q, k, v = packed("q4_1", 64, 96, 1), packed("q4_1", 32, 96, 2), packed("q4_1", 32, 96, 3)
    fused = PackedWeight.cat([q, k, v])
    parts = [q.dequantize(), k.dequantize(), v.dequantize()]
    assert torch.equal(fused.dequantize(), torch.cat(parts))
    view = fused.take_rows(torch.arange(64, 96))
    assert view.qs.untyped_storage().data_ptr() == fused.qs.untyped_storage().data_ptr()
    assert torch.equal(view.dequantize(), parts[1])
    odd = PackedWeight.cat([packed("q8_0", 33, 96, 4), packed("q8_0", 7, 96, 5)])
    assert odd.shape == (40, 96)
    assert torch.equal(odd.take_rows(torch.arange(33, 40)).dequantize(), odd.dequantize()[33:])


def test_unpermuted_rows_are_transformers_own():
    """llama.cpp's q/k permutation undone as `transformers`' GGUF loader undoes it."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = torch.arange(96 * 3).view(96, 3).numpy()
    for heads in (6, 2):
        theirs = LlamaTensorProcessor()._reverse_permute_weights(rows, heads, heads)
        assert (rows[unpermute_rows(96, heads).numpy()] == theirs).all()


def test_a_gguf_is_read_under_our_names_with_q_and_k_rows_in_hugging_faces_order(tmp_path):
    """Every matrix of a tiny GGUF (written as llama.cpp's converter does: q and k rows permuted)
    comes back as the packed weight of our parameter of that name, its values those of the
    quantized Hugging Face tensor, row for row."""
    path = save_tiny_gguf(tmp_path / "tiny.gguf")
    model = tiny_model("llama")
    weights = gguf_weights(path, model, tiny_hf_model("llama").config, torch.float32)
    params = dict(model.named_parameters())
    assert set(weights) == {name for name, p in params.items() if p.dim() == 2}
    for name, weight in weights.items():
        kind = "Q8_0" if "embed_tokens" in name else "Q4_1"
        assert weight.format == kind.lower()
        qtype = gguf.GGMLQuantizationType[kind]
        raw = gguf.quants.quantize(params[name].detach().numpy(), qtype)
        assert torch.equal(
            weight.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qtype))
        )


def test_a_type_without_a_kernel_is_refused_by_name(tmp_path):
    """Q5_K (and Q5_0, ...) have no packed kernel yet: loading says which tensor and why."""
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight is Q5_K.*no kernel yet"):
        read_quants("blk.0.ffn_down.weight", "Q5_K", torch.zeros(4, 176, dtype=torch.uint8), 256)
    path = save_tiny_gguf(tmp_path / "tiny.gguf", linear_type="Q5_0")
    with pytest.raises(ValueError, match=r"attn_q\.weight is Q5_0.*Q4_1, Q4_K and Q6_K"):
        gguf_weights(path, tiny_model("llama"), tiny_hf_model("llama").config, torch.float32)


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize(
    ("kind", "linear_type"),
    [("llama", "Q4_1"), ("llama", "Q8_0"), ("llama-wide", "Q4_K"), ("llama-wide", "Q6_K")],
)
def test_a_gguf_served_packed_stays_near_its_dequantized_model(tmp_path, kind, linear_type):
    """The tiny model served from its GGUF blocks against the same model with those weights
    dequantized: only the activations' int8 differs. Each matmul's error is at most 1/254 of a
    block's largest activation per term (about 0.5% of an output in RMS); through two layers and
    the head of these tiny models, drawn with weights ten times a real model's so that their
    attention is sharp, we measured 2.3-2.7%: held to 6%. The embedding is dequantized rows only.
    The K-quants need rows of whole super-blocks of 256: the wide tiny model (hidden 256)."""
    config = tiny_hf_model(kind).config
    path = save_tiny_gguf(tmp_path / "tiny.gguf", kind, linear_type=linear_type)
    model = tiny_model(kind)
    weights = gguf_weights(path, model, config, torch.float32)
    assert {w.format for w in weights.values()} == {"q8_0", linear_type.lower()}
    reference = tiny_model(kind)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in weights:
                param.copy_(weights[name].dequantize())  # the fused projections are views
    install(model, weights)
    assert weight_bytes(model)[1] < weight_bytes(reference)[0] / 3
    ids = prompt_ids(40, seed=1)
    embedding = model.model.embed_tokens(torch.tensor(ids))
    assert torch.equal(embedding, reference.model.embed_tokens(torch.tensor(ids)))
    assert relative_error(logits(model, ids), logits(reference, ids)) < 0.06


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_int8_stays_near_the_fp32_model(kind):
    """`--quantization int8`: each matmul adds the weights' rounding (at most 1/254 of a row's
    largest |w| per term) to the activations' (1/254 of a block's): about 1% of an output in RMS;
    through the tiny models (tied and untied heads, biases, q/k norms) we measured 3.5-6.2%: held
    to 10%."""
    model = tiny_model(kind)
    pack_weights(model, "tiny", "int8", tiny_hf_model(kind).config, "cpu")
    assert all(p.dim() == 1 for p in model.parameters())  # every matrix packed
    ids = prompt_ids(40, seed=1)
    assert relative_error(logits(model, ids), logits(tiny_model(kind), ids)) < 0.1


def test_packed_weights_are_refused_where_no_kernel_runs_and_for_files_that_are_not_gguf(
    monkeypatch,
):
    """The CPU kernels, or on a CUDA GPU the Triton kernel: another device, or a GPU without
    Triton, is refused at load with the reason."""
    import importlib.util

    model = tiny_model("llama")
    config = tiny_hf_model("llama").config
    with pytest.raises(ValueError, match="CPU or a CUDA GPU, not on mps"):
        pack_weights(model, "tiny", "int8", config, "mps")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "triton" else find_spec(name)
    )
    with pytest.raises(ValueError, match="needs Triton"):
        pack_weights(model, "tiny", "int8", config, "cuda")
    with pytest.raises(ValueError, match="not one"):
        pack_weights(model, "some/checkpoint", "gguf", config, "cpu")

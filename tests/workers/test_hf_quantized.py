"""GPTQ and AWQ int4 checkpoints served packed: their integers read as the layouts AutoGPTQ and
AutoAWQ write them, the values (q - z) * s exactly, a tiny checkpoint of each loaded through
`load_model` and near the float model of the same values, and what cannot be served refused at
load with the reason."""

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.factories import prompt_ids, save_tiny_checkpoint, tiny_model
from tests.workers.quant_cases import logits, relative_error
from workers.hf_quantized import check_method, linear_weight, read_quants
from workers.loader import load_model
from workers.quantized import Fp8Weight, PackedWeight

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the column at each nibble of an AWQ word


def pack_words(values: torch.Tensor) -> torch.Tensor:
    """`[R, C, 8]` nibbles as int32 words `[R, C]`, value i in bits 4 i."""
    words = torch.zeros(values.shape[:2], dtype=torch.int64)
    for i in range(8):
        words |= values[:, :, i].long() << (4 * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement


def quantized(n: int, k: int, group: int, seed: int = 0, lowest_zero: int = 0):
    """Random 4-bit q `[N, K]`, zeros and fp16 scales `[G, N]`: what a quantizer chose. GPTQ's
    v1 format stores z - 1 in 4 bits, so its zeros are 1-15 (gptq_v2 was made for z = 0)."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group == -1 else k // group
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(lowest_zero, 16, (groups, n), generator=g)
    scales = (torch.rand(groups, n, generator=g) / 20 + 0.01).half()
    return q, zeros, scales


def gptq_tensors(q, zeros, scales, version: str = "gptq") -> dict[str, torch.Tensor]:
    n, k = q.shape
    stored = zeros - 1 if version == "gptq" else zeros  # v1 keeps z - 1
    return {
        "qweight": pack_words(q.T.reshape(k // 8, 8, n).transpose(1, 2)),  # [K / 8, N]
        "qzeros": pack_words((stored & 0x0F).view(-1, n // 8, 8)),  # [G, N / 8]
        "scales": scales,
        "g_idx": (torch.arange(k) // (k // scales.shape[0])).to(torch.int32),
    }


def awq_tensors(q, zeros, scales) -> dict[str, torch.Tensor]:
    def words(t: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N / 8] in AWQ's column order
        columns = t.view(t.shape[0], -1, 8)
        return pack_words(columns[:, :, AWQ_ORDER])

    return {"qweight": words(q.T.contiguous()), "qzeros": words(zeros), "scales": scales}


def reference(q, zeros, scales) -> torch.Tensor:
    """w = (q - z) * s, in fp32, `[N, K]`."""
    per_group = q.shape[1] // scales.shape[0]
    z = zeros.T.repeat_interleave(per_group, dim=1).float()
    s = scales.T.repeat_interleave(per_group, dim=1).float()
    return (q.float() - z) * s


@pytest.mark.parametrize("group", [32, 64, -1])
@pytest.mark.parametrize("method", ["gptq", "gptq_v2", "awq"])
def test_packed_integers_read_as_q_minus_z_times_s(method, group):
    q, zeros, scales = quantized(40, 128, group, lowest_zero=1 if method == "gptq" else 0)
    if method == "awq":
        tensors, config = awq_tensors(q, zeros, scales), {}
    else:
        tensors = gptq_tensors(q, zeros, scales, method)
        config = {"checkpoint_format": method}
    quants = read_quants(method.removesuffix("_v2"), tensors, config)
    weight = PackedWeight.pack(quants)
    want = reference(q, zeros, scales)
    torch.testing.assert_close(weight.dequantize(), want, rtol=2e-7, atol=0)


def test_what_cannot_be_served_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="bitsandbytes.*GPTQ, AWQ and compressed-tensors"):
        check_method({"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="8 bits: pdserve serves 4-bit gptq only"):
        check_method({"quant_method": "gptq", "bits": 8, "group_size": 128})
    with pytest.raises(ValueError, match="group size 48"):
        check_method({"quant_method": "awq", "bits": 4, "group_size": 48})
    with pytest.raises(ValueError, match="GEMM layout"):
        check_method({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})
    q, zeros, scales = quantized(16, 128, 32)
    tensors = gptq_tensors(q, zeros, scales)
    tensors["g_idx"] = tensors["g_idx"].flip(0)  # act-order: k's groups out of order
    with pytest.raises(ValueError, match="act-order"):
        read_quants("gptq", tensors, {})


def quantize_groups(w: torch.Tensor, group: int = 32):
    """A float `[N, K]` weight as asymmetric 4-bit q `[N, K]`, zeros and fp16 scales `[G, N]`."""
    n, k = w.shape
    blocks = w.float().view(n, k // group, group)
    low, high = blocks.amin(dim=2).clamp(max=0), blocks.amax(dim=2).clamp(min=0)
    s = ((high - low) / 15).clamp(min=1e-4).half()  # [N, G]
    z = torch.round(-low / s.float()).clamp(1, 15).long()  # [N, G]: 1-15, as GPTQ v1 stores
    q = torch.round(blocks / s.float()[:, :, None] + z[:, :, None]).clamp(0, 15).long()
    return q.view(n, k), z.T.contiguous(), s.T.contiguous()


def save_quantized(path, method: str, form: str = ""):
    """The tiny llama checkpoint with every linear of its layers quantized to 4 bits in groups of
    32 (the embedding and head left float, as GPTQ and AWQ leave them), written as `method`
    writes it; and our model with the same values in float, for reference."""
    from safetensors.torch import load_file

    save_tiny_checkpoint(path)
    reference_model = tiny_model()
    params = dict(reference_model.named_parameters())
    state = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        module, _, last = name.rpartition(".")
        if ".layers." not in name or tensor.dim() != 2:
            state[name] = tensor
            continue
        if method in ("gptq", "awq"):
            q, z, s = quantize_groups(tensor)
            tensors = awq_tensors(q, z, s) if method == "awq" else gptq_tensors(q, z, s)
            values = reference(q, z, s)
        else:
            tensors, values = ct_tensors(tensor, form, symmetric=False)
        state.update({f"{module}.{part}": t for part, t in tensors.items()})
        with torch.no_grad():
            params[name].copy_(values)  # a view of the fused projection
    (path / "model.safetensors").unlink()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 32}
    if method == "compressed-tensors":
        bits = 4 if form == "pack-quantized" else 8
        strategy = "group" if bits == 4 else "channel"
        kind = "float" if form == "float-quantized" else "int"
        config["quantization_config"] = ct_config(form, bits, strategy, False, kind)
    config_path.write_text(json.dumps(config))
    return reference_model


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize(
    ("method", "form", "fmt"),
    [
        ("gptq", "", "q4_k"),
        ("awq", "", "q4_k"),
        ("compressed-tensors", "pack-quantized", "q4_k"),
        ("compressed-tensors", "int-quantized", "int8"),
        ("compressed-tensors", "float-quantized", None),
    ],
)
def test_a_checkpoint_loads_packed_and_stays_near_its_float_values(tmp_path, method, form, fmt):
    """Loaded by `load_model`, every linear of the layers is packed (no float copy kept; FP8's
    dequantized floats instead) and the logits stay within the activations' int8 of the float
    model of the same values (the GGUF test's bound: 6%; FP8 served as float: equal); and
    `--quantization` on top of it is refused."""
    reference_model = save_quantized(tmp_path, method, form)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    model = loaded.model
    packed = [
        m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), PackedWeight)
    ]
    ids = prompt_ids(40, seed=1)
    if fmt is None:
        assert packed == []
        assert torch.equal(logits(model, ids), logits(reference_model, ids))
    else:
        assert len(packed) == 2 * 7 and {w.format for w in packed} == {fmt}
        assert all(p.dim() == 1 for name, p in model.named_parameters() if ".layers." in name)
        assert relative_error(logits(model, ids), logits(reference_model, ids)) < 0.06
    with pytest.raises(ValueError, match=f"quantized already \\({method}\\)"):
        load_model(str(tmp_path), dtype="float32", device="cpu", quantization="int8")


def ct_config(form: str, bits: int, strategy: str, symmetric: bool = True, kind: str = "int"):
    weights = {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy}
    if strategy == "group":
        weights["group_size"] = 32
    group = {"targets": ["Linear"], "weights": weights}
    return {"quant_method": "compressed-tensors", "format": form, "config_groups": {"g": group}}


def ct_tensors(w: torch.Tensor, form: str, strategy: str = "group", symmetric: bool = True):
    """A float weight `[N, K]` as llm-compressor saves it, packed with compressed-tensors' own
    `pack_to_int32`; and its values dequantized, (q - z) * s, for reference."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = w.shape
    if form == "float-quantized":
        scale = (w.abs().amax(dim=1, keepdim=True) / 448).bfloat16()  # [N, 1]
        fp8 = (w / scale.float()).to(torch.float8_e4m3fn)
        return {"weight": fp8, "weight_scale": scale}, fp8.float() * scale.float()
    if form == "int-quantized":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).bfloat16()  # [N, 1]
        q = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale.float()
    per = 32 if strategy == "group" else k
    blocks = w.view(n, k // per, per)
    if symmetric:
        scale = (blocks.abs().amax(dim=2) / 7).clamp(min=1e-4).bfloat16()  # [N, G]
        zero = torch.zeros_like(scale, dtype=torch.int8)
    else:
        low, high = blocks.amin(dim=2).clamp(max=0), blocks.amax(dim=2).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-4).bfloat16()
        zero = (torch.round(-low / scale.float()) - 8).clamp(-8, 7).to(torch.int8)
    q = torch.round(blocks / scale.float()[:, :, None] + zero[:, :, None].float())
    q = q.clamp(-8, 7).to(torch.int8).view(n, k)
    tensors = {
        "weight_packed": pack_to_int32(q, 4),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0)
    values = (q.float().view(n, k // per, per) - zero.float()[:, :, None]) * scale.float()[
        :, :, None
    ]
    return tensors, values.view(n, k)


@pytest.mark.parametrize(
    ("form", "strategy", "symmetric"),
    [
        ("pack-quantized", "group", True),
        ("pack-quantized", "group", False),
        ("pack-quantized", "channel", True),
        ("int-quantized", "channel", True),
        ("float-quantized", "channel", True),
    ],
)
def test_compressed_tensors_weights_read_as_they_were_written(form, strategy, symmetric):
    """int4 (symmetric and with zero points, per group and per channel) and int8 come back as
    the values compressed-tensors' layout holds; FP8 as its fp8 values and per-row scales."""
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(4))
    tensors, want = ct_tensors(w, form, strategy, symmetric)
    weight = linear_weight("compressed-tensors", tensors, {})
    if form == "float-quantized":
        assert isinstance(weight, Fp8Weight) and torch.equal(weight.dequantize(), want)
        return
    packed = PackedWeight.pack(weight)
    assert packed.format == ("q4_k" if form == "pack-quantized" else "int8")
    torch.testing.assert_close(packed.dequantize(), want, rtol=2e-7, atol=0)


def test_compressed_tensors_schemes_without_a_kernel_are_refused():
    with pytest.raises(ValueError, match="format nvfp4-pack-quantized"):
        check_method(ct_config("nvfp4-pack-quantized", 4, "group"))
    with pytest.raises(ValueError, match="int4 weights per tensor"):
        check_method(ct_config("pack-quantized", 4, "tensor"))
    with pytest.raises(ValueError, match="int8 weights per group"):
        check_method(ct_config("int-quantized", 8, "group"))
    with pytest.raises(ValueError, match="float4"):
        check_method(ct_config("float-quantized", 4, "channel", kind="float"))
    assert check_method(ct_config("pack-quantized", 4, "group")) == "compressed-tensors"


def test_an_fp8_checkpoint_is_kept_fp8_for_a_gpu_and_dequantized_for_a_cpu(tmp_path):
    """compressed-tensors FP8: on a GPU each projection stays FP8 (the fused ones split as views
    of the checkpoint's rows); on a CPU, with no FP8 kernel, the same values in float."""
    from transformers import AutoConfig

    from workers.hf_quantized import split_tensors
    from workers.weights import _quantized_linears

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(5))
    tensors, want = ct_tensors(w, "float-quantized")
    save_tiny_checkpoint(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    named = {f"model.layers.0.mlp.gate_up_proj.{part}": t for part, t in tensors.items()}
    linears, _ = split_tensors(named, "compressed-tensors")
    packed, floats = _quantized_linears(
        linears, "compressed-tensors", {}, config, torch.bfloat16, "cuda"
    )
    gate, up = (
        packed["model.layers.0.mlp.gate_proj.weight"],
        packed["model.layers.0.mlp.up_proj.weight"],
    )
    assert floats == {} and isinstance(gate, Fp8Weight) and gate.dtype == torch.bfloat16
    assert torch.equal(torch.cat([gate.dequantize(), up.dequantize()]), want)
    assert gate.q.untyped_storage().data_ptr() == tensors["weight"].untyped_storage().data_ptr()
    packed, floats = _quantized_linears(
        linears, "compressed-tensors", {}, config, torch.float32, "cpu"
    )
    assert packed == {} and torch.equal(floats["model.layers.0.mlp.up_proj.weight"], want[48:])

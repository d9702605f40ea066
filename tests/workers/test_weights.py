"""A checkpoint loads tensor by tensor straight into the target dtype: the same weights as
loading through `transformers` first, and without an fp32 copy of the model on the host."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.factories import TINY_KINDS, save_tiny_checkpoint, tiny_tokenizer
from workers.loader import from_hf_model, load_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_weights_equal_those_loaded_through_transformers(tmp_path, kind, dtype):
    from transformers import AutoModelForCausalLM

    save_tiny_checkpoint(tmp_path, kind)
    # (a fresh one: Phi-3's rotary module changes its frequencies once it has seen a long input)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    expected = from_hf_model(hf, dtype)
    loaded = load_model(str(tmp_path), "float32" if dtype == torch.float32 else "bfloat16", "cpu")
    model = loaded.model
    assert model.spec == expected.spec and model.rope_scale == expected.rope_scale
    torch.testing.assert_close(model.inv_freq, expected.inv_freq, atol=0, rtol=0)
    got, want = model.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == dtype, name
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=name)
    # the fused projections the forward uses hold the loaded weights too
    layer = model.model.layers[0]
    fused = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight])
    assert torch.equal(layer.self_attn.qkv_weight[: fused.shape[0]], fused)
    assert loaded.max_context > 0


def test_a_checkpoint_missing_a_tensor_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_checkpoint(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing.*layers.0.mlp.up_proj"):
        load_model(str(tmp_path), "float32", "cpu")


_PEAK = """
import resource, sys
import torch
from transformers import AutoConfig, AutoTokenizer
from workers.loader import load_model
from workers.weights import rotary_embedding
# what loading imports either way (the tokenizer, the model's `transformers` module), before the
# baseline
AutoTokenizer.from_pretrained(sys.argv[1])
rotary_embedding(AutoConfig.from_pretrained(sys.argv[1]))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
load_model(sys.argv[1], "bfloat16", "cpu")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


@pytest.mark.slow
def test_a_bf16_model_starts_without_an_fp32_copy_on_the_host(tmp_path):
    """About 48M parameters saved in bf16 (96 MB): loading them in bf16 costs the host the
    weights, the file's pages while they are read and one tensor in fp32 (about 230 MB), not two
    fp32 copies of the model (through `transformers` first: about 480 MB)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    weights = sum(p.numel() for p in model.parameters()) * 2
    del model
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    grown = int(out.stdout.strip().splitlines()[-1])
    # the weights, plus at most the file's pages mapped while read, plus one tensor's fp32 copy
    assert grown < 2.6 * weights, (
        f"host memory grew {grown / 1e6:.0f} MB for {weights / 1e6:.0f} MB"
    )

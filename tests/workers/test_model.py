"""Our forward equals transformers' logits on the same weights, for prompt chunks and decode
steps."""

import pytest
import torch

from tests.factories import (
    LOGITS_CLOSE,
    TEST_DEVICE,
    TINY_KINDS,
    VOCAB,
    prompt_ids,
    slot_blocks,
    tiny_hf_model,
    tiny_model,
)
from workers import kernels
from workers.kv_cache import PagedKVCache
from workers.model import BatchLayout


def _run(model, cache, rows, decode_first: int):
    """rows: (slot, token_ids, start_pos); the first `decode_first` are single decode tokens. Slot
    s stands for the interleaved block table `slot_blocks(s, 4, 128)`."""
    tables = [(slot_blocks(slot, 4, 128), ids, start) for slot, ids, start in rows]
    input_ids, layout = BatchLayout.pack(tables, decode_first, 16, cache.k.device)
    logits_indices = torch.arange(len(input_ids), device=cache.k.device)
    return model(input_ids, layout, cache, logits_indices).cpu()  # [N, vocab]


# (2, 0): decode rows out of slot order with an idle row in their span; (0, 1): rows are the span
@pytest.mark.parametrize(
    ("slot_a", "slot_b"), [(2, 0), (0, 1)], ids=["scattered-slots", "span-slots"]
)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_logits_match_transformers_for_chunks_and_batched_decode(
    kind, slot_a, slot_b, kernel, monkeypatch
):
    if not kernel:  # SDPA and eager ops, as where the kernels cannot be built
        monkeypatch.setattr(kernels, "load_kernels", lambda: None)
    elif kernels.load_kernels() is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    hf, model = tiny_hf_model(kind), tiny_model(kind, TEST_DEVICE)
    spec = model.spec
    cache = paged(spec, TEST_DEVICE)
    seq_a, seq_b = prompt_ids(40, seed=1), prompt_ids(23, seed=2)
    with torch.no_grad():
        ref_a, ref_b = hf(torch.tensor([seq_a])).logits[0], hf(torch.tensor([seq_b])).logits[0]

    # prompt of A in two chunks sharing a forward with B's whole prompt minus one
    out = _run(model, cache, [(slot_a, seq_a[:16], 0), (slot_b, seq_b[:20], 0)], 0)
    torch.testing.assert_close(out[:16], ref_a[:16], **LOGITS_CLOSE)
    torch.testing.assert_close(out[16:], ref_b[:20], **LOGITS_CLOSE)
    out = _run(model, cache, [(slot_a, seq_a[16:36], 16)], 0)
    torch.testing.assert_close(out, ref_a[16:36], **LOGITS_CLOSE)
    # decode steps of both at different positions in one batched call
    for step in range(3):
        out = _run(
            model,
            cache,
            [(slot_a, [seq_a[36 + step]], 36 + step), (slot_b, [seq_b[20 + step]], 20 + step)],
            2,
        )
        torch.testing.assert_close(out[0], ref_a[36 + step], **LOGITS_CLOSE)
        torch.testing.assert_close(out[1], ref_b[20 + step], **LOGITS_CLOSE)
    assert out.shape == (2, VOCAB)


def paged(spec, device="cpu"):
    """A cache of 32 blocks of 16: four interleaved slots of 128 positions (`slot_blocks`)."""
    return PagedKVCache(
        spec.num_layers, 4 * 128 // 16, spec.num_kv_heads, 16, spec.head_dim, device=device
    )


def table(slot):
    return slot_blocks(slot, 4, 128)


def test_cache_rows_round_trip_through_export_and_import_piece_by_piece():
    model = tiny_model("llama")
    spec = model.spec
    src = paged(spec)
    dst = paged(spec)
    seq = prompt_ids(30, seed=3)
    _run(model, src, [(1, seq[:29], 0)], 0)
    # as a prefill worker sends them out
    pieces = [src.export_spans([(table(1), 0, 16)]), src.export_spans([(table(1), 16, 29)])]
    assert pieces[1].shape == (spec.num_layers, 2, spec.num_kv_heads, 13, spec.head_dim)
    assert dst.import_rows(table(2), pieces[0]) == 16
    assert dst.import_rows(table(2), pieces[1], 16) == 13
    a = _run(model, src, [(1, [seq[29]], 29)], 1)
    b = _run(model, dst, [(2, [seq[29]], 29)], 1)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_one_steps_rows_of_several_requests_travel_as_one_array():
    """A prefill step exports every request's new rows into one array (one object in the store);
    each request's piece is its span of it, at its offset."""
    model = tiny_model("llama")
    spec = model.spec
    src = paged(spec)
    seqs = [prompt_ids(20, seed=4), prompt_ids(12, seed=5)]
    _run(model, src, [(0, seqs[0][:19], 0), (1, seqs[1][:11], 0)], 0)
    rows = src.export_spans([(table(0), 0, 19), (table(1), 3, 11)])
    assert rows.shape == (spec.num_layers, 2, spec.num_kv_heads, 19 + 8, spec.head_dim)
    expected = src.export_spans([(table(1), 3, 11)])
    torch.testing.assert_close(rows[:, :, :, 19:], expected, atol=0, rtol=0)
    dst = paged(spec)
    dst.import_rows(table(1), rows[:, :, :, :19])
    a = _run(model, src, [(0, [seqs[0][19]], 19)], 1)
    b = _run(model, dst, [(1, [seqs[0][19]], 19)], 1)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_copied_block_reads_as_its_source():
    """n > 1: a choice's copy of its sibling's partly filled block, then its own tokens, give the
    logits the sibling's blocks give."""
    model = tiny_model("llama")
    cache = paged(model.spec)
    seq = prompt_ids(21, seed=6)
    _run(model, cache, [(0, seq[:20], 0)], 0)
    fork = table(0)[:1] + [table(1)[1]]  # shares block 0, copies block 1 (positions 16..19)
    cache.copy_block(table(0)[1], fork[1])
    a = _run(model, cache, [(0, [seq[20]], 20)], 1)
    ids, layout = BatchLayout.pack([(fork, [seq[20]], 20)], 1, 16, cache.k.device)
    b = model(ids, layout, cache, torch.arange(1, device=cache.k.device)).cpu()
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_fused_projections_follow_loading_and_dtype_changes():
    model = tiny_model("qwen2")  # q/k/v biases are fused too
    state = {name: t.clone() for name, t in model.state_dict().items()}
    assert (
        "model.layers.0.self_attn.q_proj.weight" in state
        and "model.layers.0.mlp.up_proj.weight" in state
    )
    attn = model.model.layers[0].self_attn
    state["model.layers.0.self_attn.v_proj.bias"] += 1.0
    model.load_state_dict(state)  # copies into the parameters, which are views of the fused tensors
    v_bias = state["model.layers.0.self_attn.v_proj.bias"]
    torch.testing.assert_close(attn.qkv_bias[-v_bias.shape[0] :], v_bias)
    model = model.to(torch.float64)  # new storage for every parameter: fused again, still shared
    attn = model.model.layers[0].self_attn
    assert attn.qkv_weight.dtype == torch.float64
    assert (
        attn.q_proj.weight.untyped_storage().data_ptr()
        == attn.qkv_weight.untyped_storage().data_ptr()
    )
    mlp = model.model.layers[1].mlp
    assert (
        mlp.up_proj.weight.untyped_storage().data_ptr()
        == mlp.gate_up_weight.untyped_storage().data_ptr()
    )


def test_bf16_model_keeps_fp32_rotary_frequencies():
    model = tiny_model("llama").to(torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(
        model.inv_freq, tiny_hf_model("llama").model.rotary_emb.inv_freq, atol=0, rtol=0
    )


def test_sliding_window_checkpoints_are_served_up_to_their_window_where_full_attention_is_exact():
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tests.factories import tiny_hf_config
    from workers.loader import from_hf_model, model_context

    common = {k: v for k, v in tiny_hf_config("qwen2").to_dict().items() if k != "layer_types"}
    config = Qwen2Config(
        **(common | {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0})
    )
    assert model_context(config) == 16
    assert (
        model_context(tiny_hf_config("mistral")) == 1024 == model_context(tiny_hf_config("llama"))
    )
    torch.manual_seed(1234)
    hf = AutoModelForCausalLM.from_config(config).eval()
    model = from_hf_model(hf)
    cache = paged(model.spec)
    seq = prompt_ids(17, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
        ours = _run(model, cache, [(0, seq, 0)], 0)
    # within the window: the same
    torch.testing.assert_close(ours[:16], ref[:16], atol=2e-5, rtol=1e-4)
    # one past it, the window drops a key: hence the cap
    assert not torch.allclose(ours[16], ref[16], atol=1e-3)


def test_an_activation_other_than_silu_is_refused_by_name():
    from tests.factories import tiny_hf_config
    from workers.hf_checkpoint import spec_from_hf

    config = tiny_hf_config("llama")
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="activation 'gelu'"):
        spec_from_hf(config, {})


def test_a_longrope_checkpoint_is_served_up_to_its_original_context_where_its_short_factors_hold():
    """Phi-3 128k: `transformers` rotates every position with the long factors once a sequence
    passes the original context, which keys cached before cannot follow; so the served context stops
    there."""
    from tests.factories import tiny_hf_config
    from workers.loader import model_context

    hf, model = tiny_hf_model("phi3"), tiny_model("phi3")
    assert model_context(tiny_hf_config("phi3")) == 64
    cache = paged(model.spec)
    seq = prompt_ids(65, seed=5)
    with torch.no_grad():
        short, long = hf(torch.tensor([seq[:64]])).logits[0], hf(torch.tensor([seq])).logits[0]
        ours = _run(model, cache, [(0, seq, 0)], 0)
    torch.testing.assert_close(ours[:64], short, atol=2e-5, rtol=1e-4)  # up to 64 tokens: the same
    # at 65, transformers re-rotates all: hence the cap
    assert not torch.allclose(long[:64], short, atol=1e-3)


def test_a_model_built_after_transformers_ran_past_the_original_context_takes_the_short_factors():
    """`transformers` keeps a longrope model's long factors in `inv_freq` after a sequence past the
    original context, until a shorter one: a model built from it then must rotate as served."""
    hf = tiny_hf_model("phi3")
    seq = prompt_ids(65, seed=6)
    with torch.no_grad():
        hf(torch.tensor([seq]))  # holds the long factors now
        model = tiny_model("phi3")
        short = hf(torch.tensor([seq[:40]])).logits[0]  # the short ones again
        ours = _run(model, paged(model.spec), [(0, seq[:40], 0)], 0)
    torch.testing.assert_close(ours, short, atol=2e-5, rtol=1e-4)


def test_a_partial_rotary_checkpoint_is_refused_by_name():
    from tests.factories import tiny_hf_config
    from workers.hf_checkpoint import spec_from_hf

    config = tiny_hf_config("phi3")
    config.rope_parameters["partial_rotary_factor"] = 0.75  # Phi-4-mini
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        spec_from_hf(config, {})

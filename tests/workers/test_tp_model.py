"""A tensor-parallel model (two gloo ranks, one thread each) computes TP-1's function: logits
within 1e-5 of the logits' scale, log-probs within 1e-4, the same greedy tokens, on uneven and
copied-KV splits."""

import functools

import pytest
import torch

from tests.workers.tp_ranks import TP_KINDS, run_ranks, tp_hf_model
from workers.kv_cache import PagedKVCache
from workers.loader import from_hf_model, load_model
from workers.model import BatchLayout
from workers.tp import TensorParallel

# partial sums added in another order differ by a few ulps of the largest activations: the
# uneven model's logits reach 11 and differ by up to 3e-5, so the bound is 1e-5 of the forward's
# largest logit (of 1 at least)
LOGITS_TOL = 1e-5
LOGPROBS_ATOL = 1e-4
NUM_DECODE_STEPS = 6


def _table(slot: int) -> list[int]:
    return [slot + 2 * k for k in range(8)]  # two interleaved slots of 128 positions


def _forward(model, cache, rows, num_decode):
    """Logits at every token of `rows` of (slot, token_ids, start_pos); None off rank 0."""
    tables = [(_table(slot), ids, start) for slot, ids, start in rows]
    input_ids, layout = BatchLayout.pack(tables, num_decode, 16, "cpu")
    return model(input_ids, layout, cache, torch.arange(len(input_ids)))


def _greedy(logits, model) -> list[int]:
    """Rank 0's argmax of `logits [M, vocab]`, on every rank."""
    if model.tp is None:
        return logits.argmax(-1).tolist()
    tokens = torch.zeros(2, dtype=torch.long) if logits is None else logits.argmax(-1)  # [M]
    torch.distributed.broadcast(tokens, src=0)
    return tokens.tolist()


def scenario(model) -> dict:
    """Two prompts in chunks (one forward holding both), then batched greedy decode steps; the
    logits of every forward and the tokens chosen."""
    cache = PagedKVCache.for_model(model, 16, 16)
    g = torch.Generator().manual_seed(7)
    vocab = model.spec.vocab_size
    seq_a = torch.randint(2, vocab, (40,), generator=g).tolist()
    seq_b = torch.randint(2, vocab, (23,), generator=g).tolist()
    logits = [
        _forward(model, cache, [(0, seq_a[:16], 0), (1, seq_b, 0)], 0),
        _forward(model, cache, [(0, seq_a[16:], 16)], 0),
    ]
    # [2, vocab]: the logits after each whole prompt
    last = None if logits[0] is None else torch.stack([logits[1][-1], logits[0][-1]])
    tokens = [_greedy(last, model)]
    for step in range(NUM_DECODE_STEPS):
        rows = [(0, [tokens[-1][0]], 40 + step), (1, [tokens[-1][1]], 23 + step)]
        out = _forward(model, cache, rows, 2)
        logits.append(out)
        tokens.append(_greedy(out, model))
    return {"logits": logits, "tokens": tokens, "kv_heads": cache.k.shape[2]}


def _rank_scenarios(checkpoint: str, rank: int, size: int) -> dict:
    """Every kind's scenario on rank `rank` of `size`, by kind, and the tiny checkpoint's loaded
    from its safetensors file (`checkpoint`), with the parameter values each rank keeps."""
    results = {}
    for kind in TP_KINDS:
        hf = tp_hf_model(kind)
        tp = TensorParallel.for_model(hf.config, size, rank)
        results[kind] = scenario(from_hf_model(hf, tp=tp))
    model = load_model(checkpoint, "float32", "cpu", tp_size=size, tp_rank=rank).model
    results["checkpoint"] = scenario(model)
    results["checkpoint"]["num_values"] = sum(p.numel() for p in model.parameters())
    return results


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, tiny_checkpoint) -> list[dict]:
    """Both ranks' results of every scenario at TP-2 (one pair of processes)."""
    scenarios = functools.partial(_rank_scenarios, tiny_checkpoint)
    return run_ranks(scenarios, 2, tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def tp1(tiny_checkpoint) -> dict:
    torch.set_num_threads(1)
    results = {kind: scenario(from_hf_model(tp_hf_model(kind))) for kind in TP_KINDS}
    model = load_model(tiny_checkpoint, "float32", "cpu").model
    results["checkpoint"] = scenario(model)
    results["checkpoint"]["num_values"] = sum(p.numel() for p in model.parameters())
    return results


KINDS = [*TP_KINDS, "checkpoint"]


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_logits_and_logprobs_match_tp1(kind, tp1, tp2):
    ref = tp1[kind]["logits"]
    got = tp2[0][kind]["logits"]
    assert all(logits is None for logits in tp2[1][kind]["logits"])  # only rank 0 has logits
    assert len(got) == len(ref) == 2 + NUM_DECODE_STEPS
    for mine, theirs in zip(got, ref, strict=True):
        assert mine.shape == theirs.shape
        scale = max(1.0, float(theirs.abs().max()))
        torch.testing.assert_close(mine, theirs, atol=LOGITS_TOL * scale, rtol=0)
        torch.testing.assert_close(
            mine.log_softmax(-1), theirs.log_softmax(-1), atol=LOGPROBS_ATOL, rtol=0
        )


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_greedy_tokens_are_tp1s(kind, tp1, tp2):
    ref = tp1[kind]["tokens"]
    assert tp2[0][kind]["tokens"] == ref
    assert tp2[1][kind]["tokens"] == ref
    # the tokens vary (a model stuck on one token would hide a wrong split)
    assert len({t for step in ref for t in step}) > 3


def test_each_rank_keeps_the_kv_heads_of_its_queries_only(tp2):
    # 3 KV heads on 2 ranks: 2 and 1; 1 KV head on 2 ranks: copied; 2 on 2: one each
    held = {kind: [tp2[r][kind]["kv_heads"] for r in range(2)] for kind in TP_KINDS}
    assert held == {"uneven-9-on-3": [2, 1], "copied-kv-4-on-1": [1, 1], "qwen3-4-on-2": [1, 1]}


def test_ranks_loading_a_checkpoint_keep_their_shard_only(tp1, tp2):
    whole = tp1["checkpoint"]["num_values"]
    kept = [tp2[rank]["checkpoint"]["num_values"] for rank in range(2)]
    # every matrix split in two; the norms (a few hundred values) on both ranks
    assert all(n < 0.51 * whole for n in kept)
    assert sum(kept) > whole


def test_gguf_blocks_are_refused_tensor_parallel_with_the_reason(tiny_checkpoint):
    with pytest.raises(ValueError, match="gguf is not served tensor-parallel yet .* use int8"):
        load_model(tiny_checkpoint, "float32", "cpu", quantization="gguf", tp_size=2, tp_rank=0)


_INT8_MATRICES = ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.up_proj")


def _rank_int8(checkpoint: str, rank: int, size: int) -> dict:
    """Layer 0's int8 matrices as this rank holds them, dequantized, and its head and MLP
    columns."""
    model = load_model(checkpoint, "float32", "cpu", "int8", size, rank).model
    layer = model.model.layers[0]
    shard = model.tp.shard
    weights = {name: layer.get_submodule(name).weight.dequantize() for name in _INT8_MATRICES}
    return {"weights": weights, "q_heads": shard.q_heads, "columns": shard.intermediate}


def test_int8_ranks_hold_tp1s_quants(qwen3_tp_checkpoint, tmp_path):
    """Each rank's int8 slices are TP-1's int8 matrix sliced: a row-parallel weight (o, down)
    takes its whole row's scale, reduced over the ranks, not its slice's."""
    whole = load_model(qwen3_tp_checkpoint, "float32", "cpu", "int8").model.model.layers[0]
    rank_int8 = functools.partial(_rank_int8, qwen3_tp_checkpoint)
    head_dim = 32
    for rank in run_ranks(rank_int8, 2, tmp_path):
        q = rank["q_heads"]
        heads = slice(q.start * head_dim, q.stop * head_dim)
        columns = slice(rank["columns"].start, rank["columns"].stop)
        full = {name: whole.get_submodule(name).weight.dequantize() for name in _INT8_MATRICES}
        expected = {
            "self_attn.q_proj": full["self_attn.q_proj"][heads],
            "self_attn.o_proj": full["self_attn.o_proj"][:, heads],
            "mlp.down_proj": full["mlp.down_proj"][:, columns],
            "mlp.up_proj": full["mlp.up_proj"][columns],
        }
        for name, weight in rank["weights"].items():
            assert torch.equal(weight, expected[name]), name

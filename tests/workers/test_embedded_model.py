"""The embedded SmolLM2-135M-Instruct answers a real question through the engine."""

import pytest
import torch

from deploy.config import EngineConfig
from deploy.driver import open_engine
from deploy.params import GenerationParams
from deploy.prompts import encode_prompt
from workers.kv_cache import PagedKVCache
from workers.loader import load_model
from workers.model import BatchLayout


@pytest.fixture(scope="module")
def loaded():
    return load_model()  # converts the GGUF once (about 20 s), then loads from the cache


def test_embedded_model_knows_the_capital_of_france(loaded):
    questions = ["What is the capital of France?", "What is 2 + 2?"]
    requests = [
        GenerationParams(temperature=0).request(
            str(i),
            encode_prompt(loaded.tokenizer, messages=[{"role": "user", "content": q}]),
            max_tokens=40,
            eos_token_ids=loaded.eos_token_ids,
            vocab_size=len(loaded.tokenizer),
        )
        for i, q in enumerate(questions)
    ]
    with open_engine(EngineConfig(slots=2, max_model_len=512), loaded) as engine:
        results = engine.run(requests)
    assert "Paris" in results["0"].text
    assert "4" in results["1"].text
    assert results["0"].finish_reason == "stop"  # it ended its answer with <|im_end|>
    assert "<|im_end|>" not in results["0"].text


def test_embedded_model_is_cached_as_safetensors(loaded):
    from workers.loader import _alias_gguf, _gguf_cache_dir

    cached = _gguf_cache_dir(_alias_gguf("smollm2-135m-instruct"))
    assert (cached / "model.safetensors").exists() and (cached / "tokenizer.json").exists()
    assert loaded.max_context == 8192 and loaded.model.spec.num_layers == 30


PEOPLE = [
    "a pirate",
    "a chef",
    "an astronaut",
    "a child",
    "a teacher",
    "a king",
    "a dog owner",
    "a runner",
    "a poet",
    "a baker",
]
PERSON = {
    "type": "object",
    "required": ["name", "age", "mood"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "neutral"]},
    },
}


def test_json_replies_parse_and_follow_their_schema(loaded):
    """20 chat prompts with a json_schema response_format (greedy and sampled): every reply is JSON
    that validates against the schema; json_object replies that end parse as JSON objects."""
    import json

    import jsonschema

    from workers.grammar import parse_response_format

    schema = parse_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    )
    anything = parse_response_format({"type": "json_object"})

    def ask(req_id, who, structured, **params):
        messages = [
            {"role": "user", "content": f"Describe {who} as JSON with a name, an age and a mood."}
        ]
        return GenerationParams(**params).request(
            req_id,
            encode_prompt(loaded.tokenizer, messages=messages),
            max_tokens=120,
            eos_token_ids=loaded.eos_token_ids,
            vocab_size=len(loaded.tokenizer),
            structured=structured,
        )

    requests = [ask(f"s{i}", who, schema, temperature=0) for i, who in enumerate(PEOPLE)]
    requests += [ask(f"t{i}", who, schema, temperature=1.0, seed=i) for i, who in enumerate(PEOPLE)]
    requests += [ask(f"o{i}", who, anything, temperature=0) for i, who in enumerate(PEOPLE)]
    with open_engine(EngineConfig(slots=16, max_model_len=512), loaded) as engine:
        results = engine.run(requests)
    for req_id, done in results.items():
        if req_id[0] in "st":
            assert done.finish_reason == "stop", (req_id, done.text)
            jsonschema.validate(json.loads(done.text), PERSON)
        elif done.finish_reason == "stop":
            assert isinstance(json.loads(done.text), dict), (req_id, done.text)
    assert sum(results[f"o{i}"].finish_reason == "stop" for i in range(len(PEOPLE))) >= 8


@pytest.fixture(scope="module")
def packed():
    return load_model(quantization="gguf")  # its Q4_1 and Q8_0 blocks, as the GGUF holds them


@pytest.mark.slow
def test_its_packed_matrices_are_transformers_dequantized_ones_row_for_row(loaded, packed):
    """Every matrix served from the GGUF's blocks dequantizes to the weight `transformers`' GGUF
    loader made of it, bit for bit: the q and k rows un-permuted the same way."""
    matrices = {n: p for n, p in loaded.model.named_parameters() if p.dim() == 2}
    assert len(matrices) == 211  # 30 layers of 7, and the tied embedding
    for name, weight in matrices.items():
        served = packed.model.get_submodule(name.removesuffix(".weight")).weight
        assert served.format == ("q8_0" if "embed_tokens" in name else "q4_1")
        assert torch.equal(served.dequantize(), weight.detach()), name


@pytest.mark.slow
def test_served_packed_its_logits_stay_near_the_dequantized_models(loaded, packed):
    """Only the activations' int8 blocks differ (llama.cpp's): each matmul's error is at most 1/254
    of a block's largest activation per term; through 30 layers and the head we measured a
    relative error of 4.1-4.6% over every position of these prompts (a logit's spread is about 8,
    its largest error about 3): held to 8%. The dequantized model's choice stays in the packed
    model's top 3."""
    for question in ["What is the capital of France?", "What is 2 + 2?"]:
        ids = encode_prompt(loaded.tokenizer, messages=[{"role": "user", "content": question}])
        want = prompt_logits(loaded.model, ids)
        got = prompt_logits(packed.model, ids)
        assert float((got - want).norm() / want.norm()) < 0.08
        assert int(want[-1].argmax()) in got[-1].topk(3).indices.tolist()


def prompt_logits(model, ids):
    spec = model.spec
    blocks = -(-len(ids) // 16)
    cache = PagedKVCache(spec.num_layers, blocks, spec.num_kv_heads, 16, spec.head_dim)
    input_ids, layout = BatchLayout.pack([(list(range(blocks)), ids, 0)], 0, 16, "cpu")
    return model(input_ids, layout, cache, torch.arange(len(ids)))  # [T, vocab]

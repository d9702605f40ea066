"""The embedded SmolLM2-135M-Instruct answers a real question through the engine."""

import pytest

from deploy.config import EngineConfig
from deploy.driver import open_engine
from deploy.params import GenerationParams
from deploy.prompts import encode_prompt
from workers.loader import load_model


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

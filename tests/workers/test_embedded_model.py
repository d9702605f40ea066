"""The embedded SmolLM2-135M-Instruct answers a real question through the engine."""

import pytest

from deploy.config import EngineConfig
from deploy.driver import open_engine
from deploy.prompts import build_request, encode_prompt
from workers.loader import load_model


@pytest.fixture(scope="module")
def loaded():
    return load_model()  # converts the GGUF once (about 20 s), then loads from the cache


def test_embedded_model_knows_the_capital_of_france(loaded):
    questions = ["What is the capital of France?", "What is 2 + 2?"]
    requests = [
        build_request(str(i), encode_prompt(loaded.tokenizer, messages=[{"role": "user", "content": q}]),
                      max_tokens=40, eos_token_ids=loaded.eos_token_ids, temperature=0)
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

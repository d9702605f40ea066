"""LoRA adapters from `--lora-modules` to every worker: a request picks its adapter by `model`;
colocated and disaggregated modes give local mode's tokens (which are `transformers` + PEFT's) on
batches mixing adapters and the base model, the prefill worker computing each prompt's KV with its
adapter; the Serve app lists the adapters in /v1/models and answers with each one's tokens."""

import httpx
import pytest
from pydantic import ValidationError

from deploy.cli import build_parser, config_from_args
from deploy.config import EngineConfig
from deploy.driver import RayEngine, open_engine
from scheduler.request import LoraRef, Request, SamplingParams
from tests.deploy.engine_configs import BASE
from tests.factories import VOCAB, peft_greedy, prompt_ids, save_lora_adapter, served_app

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("mode-loras")
    everything = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {
        "alpha": str(save_lora_adapter(root / "alpha", targets=everything, seed=11)),
        "beta": str(save_lora_adapter(root / "beta", rank=4, seed=12)),
    }


def test_the_flags_take_vllms_form_and_a_bad_one_is_refused(adapters):
    args = build_parser().parse_args(
        ["generate", "--input", "i", "--output", "o", "--max-loras", "2"]
        + ["--lora-modules", f"alpha={adapters['alpha']}", f"beta={adapters['beta']}"]
    )
    config = config_from_args(args)
    assert config.loras == {name: LoraRef(name, path) for name, path in adapters.items()}
    assert config.lora_enabled and config.max_loras == 2
    assert EngineConfig(lora_modules={"a": "/p"}).loras == {"a": LoraRef("a", "/p")}
    assert not EngineConfig().lora_enabled and EngineConfig(enable_lora=True).lora_enabled
    with pytest.raises(ValidationError, match="is not name=path"):
        EngineConfig(lora_modules=["alpha"])
    with pytest.raises(ValidationError, match="named twice"):
        EngineConfig(lora_modules=["a=/x", "a=/y"])


def mixed(adapters) -> list[Request]:
    names = [None, "alpha", "beta"]
    return [
        Request(
            f"r{i}",
            prompt_ids(length, seed=80 + i),
            10,
            SamplingParams(),
            frozenset({VOCAB - 1}),
            lora=None if names[i % 3] is None else LoraRef(names[i % 3], adapters[names[i % 3]]),
        )
        for i, length in enumerate([5, 31, 12, 47, 9, 20, 3, 60, 15])
    ]


@pytest.mark.slow
def test_every_mode_gives_each_adapters_tokens(ray_session, tiny_checkpoint, adapters):
    config = EngineConfig(model=tiny_checkpoint, lora_modules=adapters, max_loras=2, **BASE)
    with open_engine(config) as engine:
        local = {k: c.token_ids for k, c in engine.run(mixed(adapters)).items()}
    for request in mixed(adapters)[:3]:
        path = request.lora.path if request.lora else None
        assert local[request.req_id] == peft_greedy("llama", path, request.prompt_ids, 10)
    for overrides in (
        dict(mode="disaggregated", prefill_workers=1, decode_workers=1),
        dict(mode="colocated", decode_workers=2),
    ):
        with RayEngine(config.model_copy(update=overrides)) as engine:
            results = engine.run(mixed(adapters))
        assert {k: c.token_ids for k, c in results.items()} == local, overrides["mode"]


@pytest.mark.slow
def test_the_serve_app_lists_the_adapters_and_answers_with_each(
    ray_session, tiny_checkpoint, adapters
):
    args = dict(mode="colocated", slots=2, max_model_len=256, token_budget=32, prefill_chunk=16)
    prompt = prompt_ids(12, seed=3)
    with served_app(tiny_checkpoint, "loras", lora_modules=adapters, **args) as url:
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [
            ("tiny", None),
            ("alpha", "tiny"),
            ("beta", "tiny"),
        ]
        assert models[1]["root"] == adapters["alpha"]
        for model in ("tiny", "alpha", "beta"):
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            path = adapters.get(model)
            tokens = peft_greedy("llama", path, prompt, 6)
            assert reply.json()["choices"][0]["text"] == _decode(tiny_checkpoint, tokens)
        missing = httpx.post(
            f"{url}/v1/completions", json={"model": "gamma", "prompt": "hi"}, timeout=30
        )
        assert missing.status_code == 404
        assert "`tiny`, `alpha`, `beta`" in missing.json()["error"]["message"]


def _decode(checkpoint: str, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint).decode(tokens)

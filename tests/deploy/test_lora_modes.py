"""LoRA adapters from `--lora-modules` to every worker: a request picks its adapter by `model`;
colocated and disaggregated modes give local mode's tokens (which are `transformers` + PEFT's) on
batches mixing adapters and the base model, the prefill worker computing each prompt's KV with its
adapter; the Serve app lists the adapters in /v1/models and answers with each one's tokens."""

import json

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
        "gamma": str(
            save_lora_adapter(
                root / "gamma", targets=("gate_proj", "up_proj", "down_proj"), seed=13
            )
        ),
    }


def test_the_flags_take_vllms_form_and_a_bad_one_is_refused(adapters):
    args = build_parser().parse_args(
        ["generate", "--input", "i", "--output", "o", "--max-loras", "2"]
        + ["--lora-modules", f"alpha={adapters['alpha']}", f"beta={adapters['beta']}"]
    )
    config = config_from_args(args)
    named = {"alpha", "beta"}
    assert config.loras == {n: LoraRef(n, p) for n, p in adapters.items() if n in named}
    assert config.lora_enabled and config.max_loras == 2
    assert EngineConfig(lora_modules={"a": "/p"}).loras == {"a": LoraRef("a", "/p")}
    assert not EngineConfig().lora_enabled and EngineConfig(enable_lora=True).lora_enabled
    with pytest.raises(ValidationError, match="is not name=path"):
        EngineConfig(lora_modules=["alpha"])
    with pytest.raises(ValidationError, match="named twice"):
        EngineConfig(lora_modules=["a=/x", "a=/y"])


def mixed(adapters) -> list[Request]:
    """Three adapters and the base model, in turn."""
    names = [None, "alpha", "beta", "gamma"]
    return [
        Request(
            f"r{i}",
            prompt_ids(length, seed=80 + i),
            10,
            SamplingParams(),
            frozenset({VOCAB - 1}),
            lora=None if names[i % 4] is None else LoraRef(names[i % 4], adapters[names[i % 4]]),
        )
        for i, length in enumerate([5, 31, 12, 47, 9, 20, 3, 60, 15, 26, 8, 40])
    ]


@pytest.mark.slow
def test_every_mode_gives_each_adapters_tokens(ray_session, tiny_checkpoint, adapters):
    config = EngineConfig(model=tiny_checkpoint, lora_modules=adapters, max_loras=2, **BASE)
    # (two adapters at a time on each worker: the third waits, then takes a slot)
    with open_engine(config) as engine:
        local = {k: c.token_ids for k, c in engine.run(mixed(adapters)).items()}
    for request in mixed(adapters)[:4]:
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
def test_the_serve_app_lists_loads_and_unloads_adapters(
    ray_session, tiny_checkpoint, adapters, tmp_path
):
    """/v1/models lists each adapter with the served model as its parent; a completion with an
    adapter's name gives its tokens; an adapter loaded at run time is served at once, one that
    cannot be served is refused with the reason; an unloaded one is refused for new requests while
    a stream already running with it finishes with its tokens."""
    args = dict(mode="colocated", slots=2, max_model_len=256, token_budget=32, prefill_chunk=16)
    auth = {"Authorization": "Bearer key"}
    prompt = prompt_ids(12, seed=3)

    def complete(url, model, max_tokens=6):
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=120)

    def expected(path, max_tokens=6):
        return _decode(tiny_checkpoint, peft_greedy("llama", path, prompt, max_tokens))

    served = dict(lora_modules={"alpha": adapters["alpha"]}, api_key="key", **args)
    # (beta is loaded at run time below)
    with served_app(tiny_checkpoint, "loras", **served) as url:
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=30).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("alpha", "tiny")]
        assert models[1]["root"] == adapters["alpha"]
        for model, path in (("tiny", None), ("alpha", adapters["alpha"])):
            reply = complete(url, model)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == expected(path)
        missing = complete(url, "beta")
        assert missing.status_code == 404 and "`tiny`, `alpha`" in missing.text

        def load(name, path):
            body = {"lora_name": name, "lora_path": path}
            return httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth, timeout=30)

        assert httpx.post(f"{url}/v1/load_lora_adapter", json={}, timeout=30).status_code == 401
        assert load("beta", adapters["beta"]).status_code == 200
        assert complete(url, "beta").json()["choices"][0]["text"] == expected(adapters["beta"])
        again = load("beta", adapters["beta"])
        assert again.status_code == 400 and "already been loaded" in again.text
        wide = save_lora_adapter(tmp_path / "wide", rank=32)
        refused = load("wide", str(wide))
        assert refused.status_code == 400 and "above --max-lora-rank 16" in refused.text
        assert load("gone", str(tmp_path / "nothing")).status_code == 400

        body = {"model": "alpha", "prompt": prompt, "max_tokens": 40, "temperature": 0}
        body |= {"stream": True}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=auth, timeout=120
        ) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            unload = {"lora_name": "alpha"}
            gone = httpx.post(
                f"{url}/v1/unload_lora_adapter", json=unload, headers=auth, timeout=30
            )
            assert gone.status_code == 200
            rest = [line for line in lines if line.startswith("data: ")]
        chunks = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == expected(adapters["alpha"], 40)
        assert complete(url, "alpha").status_code == 404
        again = httpx.post(f"{url}/v1/unload_lora_adapter", json=unload, headers=auth, timeout=30)
        assert again.status_code == 404


def _decode(checkpoint: str, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint).decode(tokens)

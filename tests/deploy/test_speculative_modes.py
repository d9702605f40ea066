"""`--speculative-config` from the flag to every decode worker: colocated and disaggregated modes
give speculation-off local mode's greedy tokens, with drafts verified on the decode workers and
counted in the cell's stats and on /metrics; a draft model's drafts in local mode and on a decode
worker that imports its prompts' KV; a bad configuration is refused before anything starts."""

import json

import pytest
from pydantic import ValidationError

from deploy.cli import build_parser, config_from_args
from deploy.config import EngineConfig
from deploy.driver import RayEngine, open_engine
from deploy.serving.prometheus import cell_counters
from scheduler.request import SamplingParams
from tests.deploy.engine_configs import BASE, requests

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


def test_the_flag_takes_vllms_json_and_a_bad_one_is_refused_with_the_reason():
    args = build_parser().parse_args(
        ["generate", "--input", "i", "--output", "o", "--speculative-config", NGRAM]
    )
    config = config_from_args(args)
    assert config.speculative.num_speculative_tokens == 3
    assert config.speculative.prompt_lookup_min == 1
    as_mapping = EngineConfig(speculative_config={"method": "ngram"})  # the Serve config's form
    assert as_mapping.speculative.num_speculative_tokens == 4
    assert EngineConfig().speculative is None
    with pytest.raises(ValidationError, match="not JSON"):
        EngineConfig(speculative_config="{method: ngram}")
    with pytest.raises(ValidationError, match="proposes with ngram"):
        EngineConfig(speculative_config='{"method": "eagle", "model": "x"}')
    draft = EngineConfig(speculative_config={"model": "d", "num_speculative_tokens": 2})
    assert draft.speculative.method == "draft_model"  # as vLLM: a model means a draft model
    assert draft.speculative.model == "d"
    with pytest.raises(ValidationError, match="needs the draft's"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValidationError, match="proposes without a model"):
        EngineConfig(speculative_config={"method": "ngram", "quantization": "int8"})


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        dict(mode="disaggregated", prefill_workers=1, decode_workers=1),
        dict(mode="colocated", decode_workers=2),
    ],
    ids=["1P1D", "colocated"],
)
def test_greedy_tokens_equal_local_mode_without_speculation(
    ray_session, tiny_checkpoint, overrides
):
    with open_engine(EngineConfig(model=tiny_checkpoint, **BASE)) as engine:
        local = {k: c.token_ids for k, c in engine.run(greedy_and_seeded()).items()}
    config = EngineConfig(model=tiny_checkpoint, speculative_config=NGRAM, **(BASE | overrides))
    with RayEngine(config) as engine:
        results = engine.run(greedy_and_seeded())
        stats = engine.stats()
    assert {k: c.token_ids for k, c in results.items()} == local
    spec = stats["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    counters = cell_counters({"stats": stats, "serving": _no_serving()})
    assert counters[("vllm:spec_decode_num_drafts_total", ())] == spec["num_drafts"]


@pytest.mark.slow
def test_a_draft_model_drafts_in_local_mode_and_after_a_handoff(ray_session, tiny_checkpoint):
    """The served checkpoint drafting for itself: every greedy draft is right exactly when the
    draft model's KV is, and on a decode worker it reads each handed-off prompt first (the prefill
    worker never runs it)."""
    with open_engine(EngineConfig(model=tiny_checkpoint, **BASE)) as engine:
        local = {k: c.token_ids for k, c in engine.run(requests()).items()}
    draft = json.dumps({"model": tiny_checkpoint, "num_speculative_tokens": 3})
    config = EngineConfig(model=tiny_checkpoint, speculative_config=draft, **BASE)
    with open_engine(config) as engine:
        assert {k: c.token_ids for k, c in engine.run(requests()).items()} == local
        spec = engine.engine.scheduler.spec_stats.as_dict()
    assert spec["num_drafts"] > 0 and spec["acceptance_rate"] == 1.0
    disaggregated = dict(mode="disaggregated", prefill_workers=1, decode_workers=1)
    with RayEngine(config.model_copy(update=disaggregated)) as engine:
        results = engine.run(requests())
        spec = engine.stats()["spec_decode"]
    assert {k: c.token_ids for k, c in results.items()} == local
    assert spec["num_drafts"] > 0 and spec["acceptance_rate"] == 1.0


def greedy_and_seeded() -> list:
    """The modes' requests, greedy, and again seeded (a sample depends on its logits, the seed and
    its output index alone, so it is the same in every mode, with or without drafts)."""
    seeded = requests(SamplingParams(temperature=0.8, seed=21))
    for request in seeded:
        request.req_id = "seeded-" + request.req_id
    return requests() + seeded


def _no_serving() -> dict:
    return {"counters": {}, "finished": {}, "timeouts": {}, "histograms": {}}

"""colocated and disaggregated modes on Ray produce exactly what local mode produces."""

import asyncio
import json
import re

import pytest

from deploy.config import EngineConfig
from deploy.driver import RayEngine, open_engine
from deploy.engine_client import EngineClient, complete
from scheduler.request import Request, SamplingParams
from tests.deploy.engine_configs import BASE, requests
from tests.deploy.worker_doubles import FreeDecodeWorker, Gate, HeldWorker, start_engine
from tests.factories import TEST_DEVICE, VOCAB, make_requests
from tests.waiting import wait_for_stats

pytestmark = pytest.mark.slow


def run_local(checkpoint, sampling=None):
    with open_engine(EngineConfig(model=checkpoint, **BASE)) as engine:
        return engine.run(requests(sampling))


def run_mode(checkpoint, sampling=None, **overrides):
    with RayEngine(EngineConfig(model=checkpoint, **(BASE | overrides))) as engine:
        return engine.run(requests(sampling)), engine.stats()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(mode="disaggregated", prefill_workers=1, decode_workers=1),
        dict(mode="disaggregated", prefill_workers=2, decode_workers=2),
        dict(mode="colocated", decode_workers=2),
        dict(mode="disaggregated", local_prefill_max_tokens=16),  # short prompts skip the handoff
        dict(mode="colocated", max_burst_ms=0),  # one decode step per call to a worker
        # KV read one-sidedly from the prefill worker's memory (Ray Direct Transport)
        dict(mode="disaggregated", prefill_workers=2, decode_workers=2, kv_transport="nixl"),
    ],
    ids=["1P1D", "2P2D", "colocated", "conditional", "no-bursts", "nixl"],
)
def test_greedy_outputs_equal_local_mode(ray_session, tiny_checkpoint, overrides):
    local = run_local(tiny_checkpoint)
    results, stats = run_mode(tiny_checkpoint, **overrides)
    for req_id, expected in local.items():
        got = results[req_id]
        assert got.token_ids == expected.token_ids, req_id
        assert got.finish_reason == expected.finish_reason and got.error is None
        assert len(got.token_times_s) == len(got.token_ids) and got.token_times_s == sorted(
            got.token_times_s
        )
    assert stats["live_handoffs"] == 0 and stats["streams"] == 0
    assert all(w["slots_used"] == 0 and w["waiting"] == 0 for w in stats["workers"].values())
    handed_off = {r: c.metrics["kv_handoff_bytes"] > 0 for r, c in results.items()}
    if overrides["mode"] == "colocated":
        assert not any(handed_off.values())
    elif overrides.get("local_prefill_max_tokens"):
        short = {r.req_id for r in requests() if len(r.prompt_ids) < 16}
        assert {r for r, h in handed_off.items() if not h} == short
    else:
        assert all(handed_off.values())
        assert all(c.metrics["kv_handoff_s"] > 0 for c in results.values())
    if overrides["mode"] == "disaggregated":  # every byte fetched was counted, with its transport
        # auto: the object store on CPUs, CUDA IPC between workers that share a GPU
        default = "cuda_ipc" if TEST_DEVICE.startswith("cuda") else "object_store"
        transport = overrides.get("kv_transport", default)
        assert set(stats["kv_transfer"]) == {transport}
        assert stats["kv_transfer"][transport]["bytes"] > 0
        assert stats["kv_transfer"][transport]["failures"] == 0
    if overrides.get("decode_workers") == 2:  # load was spread over both pools
        assert {c.metrics["decode_worker"] for c in results.values()} == {0, 1}
    if overrides.get("max_burst_ms") == 0:  # one decode step per call, whatever the timing
        assert stats["timeline"]["decode"]["steps_per_call"] == 1


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_decode_only_tail_is_carried_in_bursts_with_the_same_tokens(
    ray_session, tiny_checkpoint, mode
):
    """Once every running request only decodes, a call to the decode worker carries several steps,
    each fed the tokens of the one before. Long answers to short prompts leave about a hundred such
    steps. How many steps a call carries is the scheduler's reading of measured times; the workers
    here report their decode steps as free (`FreeDecodeWorker`), so every call that may carry a
    burst carries one, on any host."""

    def tail():
        return make_requests(3, [5, 9, 12], [120, 110, 100])

    with open_engine(EngineConfig(model=tiny_checkpoint, **BASE)) as engine:
        local = engine.run(tail())
    config = EngineConfig(model=tiny_checkpoint, **(BASE | dict(mode=mode)))
    with start_engine(config, FreeDecodeWorker) as engine:
        results, stats = engine.run(tail()), engine.stats()
    assert {k: c.token_ids for k, c in results.items()} == {
        k: c.token_ids for k, c in local.items()
    }
    assert all(len(results[r.req_id].token_ids) == r.max_tokens for r in tail())
    assert stats["timeline"]["decode"]["steps_per_call"] > 1


def test_seeded_sampling_equals_local_mode_in_every_mode(ray_session, tiny_checkpoint):
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11)
    local = run_local(tiny_checkpoint, sampling)
    for overrides in (dict(mode="disaggregated"), dict(mode="colocated")):
        results, _ = run_mode(tiny_checkpoint, sampling, **overrides)
        assert {k: c.token_ids for k, c in results.items()} == {
            k: c.token_ids for k, c in local.items()
        }


def staged(engine, first, later, running, pause_s=0.05, meanwhile=None):
    """On a Ray engine, run `first`, then `later` (one every `pause_s`) once decode-0 runs `running`
    requests, then await `meanwhile()` if given; returns the completions by id and the scheduler's
    stats at the end, and closes the engine."""
    handle, client = engine.handle, EngineClient(engine.handle)

    async def scenario():
        tasks = [asyncio.create_task(complete(client, r)) for r in first]
        await wait_for_stats(handle, lambda s: s["workers"]["decode-0"]["running"] >= running)
        for request in later:
            tasks.append(asyncio.create_task(complete(client, request)))
            await asyncio.sleep(pause_s)  # arrivals spread out, not one burst
        if meanwhile is not None:
            await meanwhile()
        done = await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)
        return {c.req_id: c for c in done}, await handle.stats.remote()

    try:
        return asyncio.run(scenario())
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_preemption_keeps_every_output_equal_to_local(ray_session, tiny_checkpoint, mode):
    """Two slots, six long normal requests, two urgent ones arriving mid-run: urgent ones evict
    normal ones, which recompute (on the prefill pool, when there is one) and still produce local's
    tokens."""
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=3)

    def workload():
        normal = make_requests(
            6, [5, 31, 12, 47, 9, 20], [60, 45, 70, 50, 55, 65], sampling=sampling
        )
        urgent = make_requests(8, [7, 15], [12, 9], sampling=sampling)[6:]
        for r in normal:
            r.priority = 1
        return normal + urgent

    with open_engine(EngineConfig(model=tiny_checkpoint, **BASE)) as engine:
        expected = {r.req_id: engine.run([r])[r.req_id].token_ids for r in workload()}
    requests = workload()
    results, stats = staged(
        RayEngine(EngineConfig(model=tiny_checkpoint, mode=mode, **(BASE | {"slots": 2}))),
        # the urgent ones once both slots are busy
        requests[:6],
        requests[6:],
        running=2,
    )
    assert {k: c.token_ids for k, c in results.items()} == expected
    assert stats["counters"]["preemptions"] >= 1
    assert (
        sum(c.metrics["preemptions"] for c in results.values()) == stats["counters"]["preemptions"]
    )
    assert all(w["slots_used"] == 0 for w in stats["workers"].values())


def test_kv_imported_into_a_reserved_slot_while_prefilling_equals_local(
    ray_session, tiny_checkpoint
):
    """A long prompt prefills in many chunks while another request decodes: its pieces go into a
    decode slot reserved for it with the decode steps (`early_imports`), and its tokens are still
    local's. Its last chunk is held (`HeldWorker`) until a piece has gone in: on a loaded host the
    prefill worker could otherwise end the prompt before the decode worker's next step."""

    def workload():
        return make_requests(2, [4, 150], [150, 6], stop_token_ids=frozenset())  # steady, long

    with open_engine(EngineConfig(model=tiny_checkpoint, **BASE)) as engine:
        expected = {r.req_id: engine.run([r])[r.req_id].token_ids for r in workload()}
    config = EngineConfig(
        model=tiny_checkpoint, mode="disaggregated", **(BASE | {"max_model_len": 200})
    )
    steady, long = workload()
    gate = Gate.remote()
    engine = start_engine(config, HeldWorker, gate)

    async def open_once_imported_early():
        await wait_for_stats(engine.handle, lambda s: s["counters"]["early_imports"] >= 1)
        await gate.open.remote()

    # the long prompt once the other decodes
    results, stats = staged(engine, [steady], [long], running=1, meanwhile=open_once_imported_early)
    assert {k: c.token_ids for k, c in results.items()} == expected
    assert results["r1"].finish_reason == "length" and stats["counters"]["early_imports"] >= 1
    assert all(w["slots_used"] == 0 for w in stats["workers"].values())


def sampling_variety():
    """Penalties, logit_bias, min_tokens, log-probs, echo log-probs, and three seeded choices of one
    prompt."""
    from tests.workers.sampling_cases import processed_requests

    prompt = make_requests(1, [20], [1])[0].prompt_ids
    choices = [
        Request(
            req_id=f"n-{i}",
            prompt_ids=prompt,
            max_tokens=10,
            fork_of="n-0" if i else None,
            sampling=SamplingParams(
                temperature=0.9, seed=70 + i, frequency_penalty=0.5, logprobs=2
            ),
        )
        for i in range(3)
    ]
    from workers.grammar import parse_response_format, parse_structured_outputs

    schema = {
        "type": "object",
        "required": ["size"],
        "properties": {"size": {"type": "integer", "maximum": 99}},
    }
    specs = {
        "json": parse_response_format(
            {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        ),
        "regex": parse_structured_outputs({"regex": "[0-9]{2,4}-[a-z]+"}),
        "choice": parse_structured_outputs({"choice": ["north", "south", "east or west"]}),
    }
    structured = [
        Request(
            req_id=f"{kind}-{i}",
            prompt_ids=prompt,
            max_tokens=30,
            stop_token_ids=frozenset({VOCAB - 1}),
            sampling=SamplingParams(temperature=1.0, seed=i, structured=spec),
        )
        for kind, spec in specs.items()
        for i in range(2)
    ]
    return processed_requests() + choices + structured


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_sampling_parameters_equal_local_mode(ray_session, tiny_checkpoint, mode):
    with open_engine(EngineConfig(model=tiny_checkpoint, **BASE)) as engine:
        local = engine.run(sampling_variety())
    with RayEngine(EngineConfig(model=tiny_checkpoint, mode=mode, **BASE)) as engine:
        results = engine.run(sampling_variety())
    for req_id, expected in local.items():
        got = results[req_id]
        assert (
            got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason
        ), req_id
        assert [t.token_id for t in got.logprobs] == [t.token_id for t in expected.logprobs]
        assert [t.logprob for t in got.logprobs] == pytest.approx(
            [t.logprob for t in expected.logprobs], abs=1e-4
        )
        assert (got.prompt_logprobs is None) == (expected.prompt_logprobs is None)
        if expected.prompt_logprobs is not None:
            assert [t.logprob for t in got.prompt_logprobs] == pytest.approx(
                [t.logprob for t in expected.prompt_logprobs], abs=1e-4
            )
    # a prompt of 12 tokens: all but the first
    assert len(results["presence"].prompt_logprobs) == 11
    assert (
        results["min_tokens"].token_ids[-1] == VOCAB - 1
        and len(results["min_tokens"].token_ids) == 7
    )
    assert all(json.loads(results[f"json-{i}"].text)["size"] <= 99 for i in range(2))
    assert all(re.fullmatch("[0-9]{2,4}-[a-z]+", results[f"regex-{i}"].text) for i in range(2))
    assert all(results[f"choice-{i}"].text in ("north", "south", "east or west") for i in range(2))


@pytest.mark.parametrize(
    "overrides",
    [dict(mode="colocated", decode_workers=2), dict(mode="disaggregated", prefill_workers=2)],
    ids=["colocated", "2P1D"],
)
def test_prefix_cache_changes_no_output_and_routes_to_the_cache(
    ray_session, tiny_checkpoint, overrides
):
    """Three waves of prompts sharing a 40-token prefix (plus two with nothing shared), greedy and
    seeded: local mode without the cache gives the same tokens; the later waves find the prefix
    cached on the worker they went to."""
    from tests.factories import prompt_ids

    system = prompt_ids(40, 77)

    def waves():
        seeded = SamplingParams(temperature=0.8, top_k=40, seed=4)
        shared = [
            Request(
                req_id=f"s{i}",
                prompt_ids=system + prompt_ids(3 + i, 80 + i),
                max_tokens=6,
                sampling=seeded if i % 2 else SamplingParams(),
            )
            for i in range(6)
        ]
        other = [
            Request(req_id=f"o{i}", prompt_ids=prompt_ids(30, 90 + i), max_tokens=6)
            for i in range(2)
        ]
        return [shared[:2] + other[:1], shared[2:4] + other[1:], shared[4:]]

    with open_engine(EngineConfig(model=tiny_checkpoint, prefix_cache_tokens=0, **BASE)) as engine:
        expected = {k: c.token_ids for wave in waves() for k, c in engine.run(wave).items()}
    with RayEngine(EngineConfig(model=tiny_checkpoint, **(BASE | overrides))) as engine:
        got = {k: c.token_ids for wave in waves() for k, c in engine.run(wave).items()}
        stats = engine.stats()["workers"]
    assert got == expected
    assert all("kv_cache" in w for w in stats.values())
    caches = [w["kv_cache"] for w in stats.values()]
    # the 4 later shared prompts: 2 blocks each
    assert sum(c["hit_tokens"] for c in caches) >= 4 * 32


def test_a_conversations_later_turns_are_not_computed_again(ray_session, tiny_checkpoint):
    """Disaggregated, three turns, each prompt the conversation so far plus a few new tokens: turns
    2 and 3 find everything but the new tokens cached on the decode worker that generated the last
    reply, are computed there (no prefill, no handoff) and equal local mode's turns."""
    from tests.factories import prompt_ids

    def turns(engine):
        history = prompt_ids(40, 7)
        done = []
        for turn in range(3):
            prompt = history + prompt_ids(5, 70 + turn)
            request = Request(req_id=f"t{turn}", prompt_ids=prompt, max_tokens=12)
            result = engine.run([request])[request.req_id]
            done.append(result)
            history = prompt + result.token_ids
        return done

    with open_engine(EngineConfig(model=tiny_checkpoint, **BASE)) as engine:
        expected = turns(engine)
    config = EngineConfig(model=tiny_checkpoint, mode="disaggregated", **BASE)
    with RayEngine(config) as engine:
        got = turns(engine)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert got[0].metrics["kv_handoff_bytes"] > 0
    for later in got[1:]:
        assert later.metrics["kv_handoff_bytes"] == 0 and later.metrics["prefill_worker"] is None
        # all but the new tokens and the last, partly filled block of the conversation so far
        assert later.metrics["cached_tokens"] >= later.prompt_tokens - 5 - 16


def test_block_pressure_with_shared_prefixes_and_choices_equals_local(ray_session, tiny_checkpoint):
    """Two prefill and two decode workers of 16 blocks each (a context and a half), the prefix
    cache on: prompts sharing a prefix, urgent and normal ones, three choices of one prompt, all
    at once. Preemption, blocks reserved and given back, handoffs that skip cached blocks: every
    output is local mode's (roomy, no cache)."""
    from tests.factories import prompt_ids

    system = prompt_ids(37, 5)
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=11)

    def workload():
        requests = [
            Request(
                req_id=f"r{i}",
                prompt_ids=(system if i % 3 else []) + prompt_ids(5 + 7 * i, 40 + i),
                max_tokens=20 + 9 * (i % 4),
                priority=i % 2,
                sampling=seeded if i % 2 else SamplingParams(),
            )
            for i in range(8)
        ]
        return requests + [
            Request(
                req_id=f"n-{i}",
                prompt_ids=system + prompt_ids(9, 60),
                max_tokens=24,
                fork_of="n-0" if i else None,
                sampling=SamplingParams(temperature=0.9, seed=70 + i),
            )
            for i in range(3)
        ]

    with open_engine(EngineConfig(model=tiny_checkpoint, prefix_cache_tokens=0, **BASE)) as engine:
        expected = {k: c.token_ids for k, c in engine.run(workload()).items()}
    tight = BASE | dict(
        mode="disaggregated", prefill_workers=2, decode_workers=2, kv_cache_memory="128KiB"
    )
    with RayEngine(EngineConfig(model=tiny_checkpoint, **tight)) as engine:
        got = {k: c.token_ids for k, c in engine.run(workload()).items()}
        stats = engine.stats()
    assert got == expected
    assert stats["counters"]["preemptions"] >= 1
    assert all(w["slots_used"] == 0 for w in stats["workers"].values())


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_int8_weights_give_local_modes_tokens_in_every_mode(ray_session, tiny_checkpoint, mode):
    """`--quantization int8` reaches every worker: each packs the same weights and runs the same
    kernel, whose rows do not depend on their batch; the tokens are local mode's, and not those of
    the fp32 weights."""
    with open_engine(EngineConfig(model=tiny_checkpoint, **BASE, quantization="int8")) as engine:
        local = engine.run(requests())
    results, _ = run_mode(tiny_checkpoint, mode=mode, quantization="int8")
    tokens = {k: c.token_ids for k, c in results.items()}
    assert tokens == {k: c.token_ids for k, c in local.items()}
    assert tokens != {k: c.token_ids for k, c in run_local(tiny_checkpoint).items()}


def test_the_embedded_gguf_served_packed_gives_local_modes_tokens_disaggregated(ray_session):
    """The embedded model from its Q4_1 and Q8_0 blocks: a prefill and a decode worker each read
    the GGUF, and the greedy answers are local mode's token for token."""
    from deploy.prompts import encode_prompt
    from workers.loader import load_tokenizer

    info = load_tokenizer()
    questions = ["What is the capital of France?", "Name three colours."]
    prompts = [
        encode_prompt(info.tokenizer, messages=[{"role": "user", "content": q}]) for q in questions
    ]

    def answers():
        return [
            Request(req_id=str(i), prompt_ids=ids, max_tokens=16, stop_token_ids=info.eos_token_ids)
            for i, ids in enumerate(prompts)
        ]

    config = dict(quantization="gguf", slots=2, max_model_len=256, dtype="float32", device="cpu")
    with open_engine(EngineConfig(**config)) as engine:
        local = engine.run(answers())
    with RayEngine(EngineConfig(mode="disaggregated", **config)) as engine:
        results = engine.run(answers())
    assert {k: c.token_ids for k, c in results.items()} == {
        k: c.token_ids for k, c in local.items()
    }
    assert all(len(c.token_ids) > 3 for c in results.values())

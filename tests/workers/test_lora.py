"""LoRA adapters in the in-process engine on tiny models: each request's greedy tokens equal
`transformers` + PEFT's for its adapter, in batches mixing adapters and the base model; at most
`max_loras` adapters run at once; KV of two adapters never shares a block; an adapter that cannot
be served is refused with the reason."""

from types import SimpleNamespace

import pytest
import torch

from scheduler.request import LoraRef, Request, SamplingParams
from tests.factories import (
    VOCAB,
    local_engine,
    peft_greedy,
    prompt_ids,
    save_lora_adapter,
    tiny_model,
)
from workers import kernels
from workers.lora import (
    ADAPTER_FILES,
    MODULES,
    LoraAdapter,
    LoraBatch,
    LoraError,
    LoraSlots,
    projection_shapes,
    read_adapter,
)

pytest.importorskip("peft")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three adapters of the tiny llama: every module at rank 8; q and v at rank 4 with rsLoRA;
    the MLP and o at rank 16."""
    root = tmp_path_factory.mktemp("loras")
    return {
        "all": save_lora_adapter(root / "all", targets=ATTENTION + MLP, seed=1),
        "qv": save_lora_adapter(
            root / "qv", rank=4, targets=("q_proj", "v_proj"), use_rslora=True, seed=2
        ),
        "mlp": save_lora_adapter(root / "mlp", rank=16, targets=MLP + ("o_proj",), seed=3),
    }


def ref(adapters, name):
    return None if name is None else LoraRef(name, str(adapters[name]))


def mixed(adapters, names=(None, "all", "qv", "mlp"), lengths=(5, 23, 40), max_tokens=12):
    """Every prompt under every adapter and the base model, interleaved."""
    return [
        Request(
            f"{name}-{i}",
            prompt_ids(length, seed=60 + i),
            max_tokens,
            SamplingParams(),
            frozenset({VOCAB - 1}),
            lora=ref(adapters, name),
        )
        for i, length in enumerate(lengths)
        for name in names
    ]


@pytest.mark.parametrize(
    ("dtype", "slot_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),  # --lora-dtype bfloat16 on an fp32 model
    ],
)
def test_each_token_gains_its_own_adapters_update(dtype, slot_dtype, monkeypatch):
    """`LoraBatch.add`, through the kernel and through the torch ops, against each token's update
    computed alone: tokens of three slots and of the base model interleaved, one slot with a
    prompt chunk's many tokens, adapters of ranks below the slots' width and of some modules only,
    and a slot whose adapter was replaced (its old weights must not leak). Adapters of bf16
    values lose nothing in bf16 slots: fp32 activations then match to fp32's tolerance."""
    if kernels.load_kernels() is None:
        pytest.skip("no CPU kernels here")
    spec = SimpleNamespace(
        hidden_size=48, num_heads=3, num_kv_heads=1, head_dim=16, intermediate_size=80, num_layers=2
    )
    weight = torch.zeros(1, dtype=dtype)
    model = SimpleNamespace(
        spec=spec, model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight))
    )
    shapes = projection_shapes(48, 3, 1, 16, 80)
    generator = torch.Generator().manual_seed(0)

    def adapter(rank, modules):
        weights = {}
        for layer in range(2):
            for module in modules:
                site, index = MODULES[module]
                width, outs = shapes[site]
                a = (torch.randn(rank, width, generator=generator) / 4).to(slot_dtype).float()
                b = (torch.randn(outs[index], rank, generator=generator) / 4).to(slot_dtype).float()
                weights[layer, module] = (a, b)
        return LoraAdapter(LoraRef(f"r{rank}", "/nowhere"), rank, weights)

    slots = LoraSlots(model, 4, 8, slot_dtype)
    every = tuple(MODULES)
    held = [adapter(8, every), adapter(3, ("q_proj", "v_proj", "down_proj")), adapter(8, every)]
    slots.write(0, adapter(8, every))  # replaced below
    for slot, each in enumerate(held):
        slots.write(slot, each)
    token_slots = [0, -1, 1, 2, 2, -1, 1, 0] + [1] * 20 + [-1, 0]
    batch = LoraBatch.of(slots, token_slots)
    assert batch.own and batch.per_slot  # both torch paths run
    for site, (width, outs) in shapes.items():
        x = torch.randn(len(token_slots), width, generator=generator).to(dtype)  # [N, in]
        base = torch.randn(len(token_slots), sum(outs), generator=generator).to(dtype)
        expected = base.float().clone()
        for n, slot in enumerate(token_slots):
            if slot < 0:
                continue
            first = 0
            for module, (module_site, _) in MODULES.items():
                if module_site != site:
                    continue
                width_out = outs[MODULES[module][1]]
                if (1, module) in held[slot].modules:
                    a, b = held[slot].modules[1, module]
                    expected[n, first : first + width_out] += b @ (a @ x[n].float())
                first += width_out
        for kernel in (True, False):
            if not kernel:
                monkeypatch.setattr(kernels, "load_kernels", lambda: None)
            out = base.clone()
            batch.add(out, x, 1, site)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
        monkeypatch.undo()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch-ops"])
@pytest.mark.parametrize(
    ("budget", "chunk"), [(48, 16), (160, 64)], ids=["decode-rows-batched", "chunks-alone"]
)
def test_mixed_batches_give_each_adapters_peft_tokens(adapters, budget, chunk, kernel, monkeypatch):
    """The kernel (`csrc/lora.cpp`), and the torch ops where it does not apply: with small steps
    these multiply every slot's tokens in one batched matmul, with long prompt chunks a slot of
    many tokens alone (`OWN_MATMUL_TOKENS`): each way gives PEFT's tokens."""
    if not kernel:
        monkeypatch.setattr(kernels, "load_kernels", lambda: None)
    eng = local_engine(tiny_model(), 8, 200, token_budget=budget, prefill_chunk=chunk, max_loras=4)
    done = eng.run(mixed(adapters))
    outputs = {r: d.output_ids for r, d in done.items()}
    for request in mixed(adapters):
        name = request.lora.name if request.lora else None
        expected = peft_greedy("llama", adapters.get(name), request.prompt_ids, 12)
        assert outputs[request.req_id] == expected, request.req_id
    # the adapters do change the tokens
    assert len({tuple(outputs[f"{n}-1"]) for n in ("None", "all", "qv", "mlp")}) == 4
    assert eng.runner.loras.num_loads == 3


def test_bf16_slots_lose_nothing_of_adapters_trained_in_bf16(tmp_path):
    """`--lora-dtype bfloat16` on an fp32 model halves the adapters' bytes; adapters whose weights
    are bf16 values (trained in bf16) give PEFT's tokens as fp32 slots do."""
    adapters = {
        name: save_lora_adapter(
            tmp_path / name, targets=ATTENTION + MLP, seed=seed, bf16_values=True
        )
        for name, seed in (("x", 4), ("y", 5))
    }
    eng = local_engine(
        tiny_model(), 8, 200, token_budget=48, prefill_chunk=16, max_loras=2, lora_dtype="bfloat16"
    )
    requests = mixed(adapters, names=(None, "x", "y"), lengths=(5, 23))
    done = eng.run(requests)
    for request in requests:
        name = request.lora.name if request.lora else None
        expected = peft_greedy("llama", adapters.get(name), request.prompt_ids, 12)
        assert done[request.req_id].output_ids == expected, request.req_id
    assert eng.runner.loras.slots.a[0]["qkv"].dtype == torch.bfloat16


def test_max_loras_bounds_the_adapters_running_at_once(adapters):
    """Two adapters at most: a request of a third waits for one to end; tokens unchanged."""
    eng = local_engine(tiny_model(), 8, 200, token_budget=48, prefill_chunk=16, max_loras=2)
    seen = []
    plan = eng.scheduler.plan

    def watched(*args, **kwargs):
        step = plan(*args, **kwargs)
        seen.append({r.lora for r in eng.scheduler.running if r.lora is not None})
        return step

    eng.scheduler.plan = watched
    done = eng.run(mixed(adapters))
    assert max(len(s) for s in seen) == 2 and len(set().union(*seen)) == 3
    wide = local_engine(tiny_model(), 8, 200, token_budget=48, prefill_chunk=16, max_loras=4)
    expected = wide.run(mixed(adapters))
    assert {r: d.output_ids for r, d in done.items()} == {
        r: d.output_ids for r, d in expected.items()
    }


def test_two_adapters_never_share_a_cached_block(adapters):
    """The same prompt under the same adapter reuses its cached blocks; under another adapter, or
    the base model, it computes its own."""
    prompt = prompt_ids(48, seed=5)

    def run(eng, name, req_id):
        request = Request(req_id, prompt, 4, SamplingParams(), lora=ref(adapters, name))
        return eng.run([request])[req_id].output_ids

    eng = local_engine(tiny_model(), 4, 200, prefix_caching=True, max_loras=4)
    first = run(eng, "all", "a")
    hits = eng.scheduler.blocks.hit_tokens
    assert run(eng, "all", "b") == first and eng.scheduler.blocks.hit_tokens > hits
    for name in ("qv", None):
        hits = eng.scheduler.blocks.hit_tokens
        out = run(eng, name, f"other-{name}")
        assert eng.scheduler.blocks.hit_tokens == hits
        assert out == peft_greedy("llama", adapters.get(name), prompt, 4)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "no adapter_config.json"),
        (lambda p: save_lora_adapter(p / "wide", rank=32), "rank 32, above --max-lora-rank 16"),
        (
            lambda p: save_lora_adapter(p / "embed", targets=("embed_tokens", "q_proj")),
            "not a decoder layer's LoRA weight",
        ),
        (
            lambda p: save_lora_adapter(p / "dora", use_dora=True),
            "DoRA adapters are not served",
        ),
    ],
    ids=["missing", "rank", "embedding", "dora"],
)
def test_an_adapter_that_cannot_be_served_is_refused_with_the_reason(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(LoraError, match=message):
        read_adapter(LoraRef("bad", str(path)), tiny_model(), max_rank=16)


def test_an_adapter_of_another_model_is_refused_naming_the_shapes(tmp_path):
    path = save_lora_adapter(tmp_path / "qwen3", kind="qwen3", targets=("q_proj",))
    with pytest.raises(LoraError, match=r"q_proj of layer 0 has A \(8, 64\) and B \(128, 8\)"):
        read_adapter(LoraRef("q3", str(path)), tiny_model(), max_rank=16)


def test_adapters_are_read_from_uris(adapters, tmp_path, monkeypatch):
    """A `file://` URI reads its directory; another scheme (fsspec's in-memory filesystem here, as
    `s3://` or `gs://` would be with their filesystems installed) is fetched into the cache
    first: both give PEFT's tokens for the adapter. A URI that cannot be fetched, or that holds no
    adapter, is refused with the reason."""
    import fsspec

    monkeypatch.setenv("PDSERVE_LORA_CACHE", str(tmp_path / "cache"))
    memory = fsspec.filesystem("memory")
    for name in ADAPTER_FILES:
        if (adapters["all"] / name).is_file():
            memory.put(str(adapters["all"] / name), f"/adapters/all/{name}")
    uris = {"file": f"file://{adapters['all']}", "memory": "memory://adapters/all"}
    prompt = prompt_ids(23, seed=70)
    requests = [
        Request(scheme, prompt, 8, SamplingParams(), lora=LoraRef(scheme, uri))
        for scheme, uri in uris.items()
    ]
    done = local_engine(tiny_model(), 4, 200, max_loras=2).run(requests)
    expected = peft_greedy("llama", adapters["all"], prompt, 8)
    assert [done[scheme].output_ids for scheme in uris] == [expected, expected]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the fetched copy
    with pytest.raises(LoraError, match="cannot fetch nosuchscheme://a/b"):
        read_adapter(LoraRef("x", "nosuchscheme://a/b"), tiny_model(), max_rank=16)
    with pytest.raises(LoraError, match="no adapter_config.json in memory://empty"):
        read_adapter(LoraRef("y", "memory://empty"), tiny_model(), max_rank=16)

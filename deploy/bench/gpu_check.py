"""`pdserve gpu-check`: one command that checks a GPU machine whole in minutes and says, in one
JSON object, what works.

Each check runs on its own (a failure is recorded, the next check still runs); the command exits
non-zero if any failed. The checks, in order:

* `versions`: torch, CUDA, transformers, Ray, NIXL, the device, and the attention each path runs.
* `logits_fp32`: our forward against `transformers` on the device, fp32, prompt chunks and batched
  decode steps of a random model: max |Δ logit| ≤ 1e-3 (TF32 off).
* `logprobs_bf16`: teacher-forced log-probs of the embedded SmolLM2 in bf16 are no further from the
  fp32 model than `transformers` in bf16 is, by the factors of tests/workers/test_bf16.py (the mean
  |Δ log p| within 1.2x `transformers`', the worst within 1.5x).
* `greedy`: the local engine's greedy tokens equal `transformers`' `generate` on a peaked-logit
  model, and batched requests equal each run alone.
* `sampling`: every sampling option once on the device; seeded runs repeat exactly.
* `kv_transports`: a KV export → import round trip between two Ray actors per transport the
  machine has, rows exact, with GB/s, beside a device-to-device copy's.
* `quantized`: the model's matrices packed in int8 (`--quantization int8`: the Triton kernel on a
  GPU, the C++ one on a CPU): its logits against an fp32 model of the same int8 values
  dequantized (within 1e-3 relative on a GPU, which multiplies the dequantized tile; 6% on a CPU,
  whose kernel rounds activations to int8), and its greedy tokens batched equal each run alone;
  on a GPU also `--quantization fp8` in bf16 against bf16 weights of the same FP8 values (10%:
  each activation row rounded to e4m3's 3 mantissa bits, about 3% RMS a matmul).
* `disaggregated`: one prefill and one decode worker (half a GPU each where there is one) give the
  local engine's tokens; the handoff's GB/s per transport.
* `graphs`: the engine with CUDA graphs against `--enforce-eager`: greedy tokens identical in fp32,
  log-probs within bf16's limits in bf16, a replay without a host sync, the graphs' count and
  capture time (skipped on a CPU, which captures none).
* `tp_handoff`: a TP-1 prefill worker hands its KV to a TP-2 decode worker (a third of the GPU per
  rank): local mode's tokens, over NCCL where it takes two ranks on one GPU, else gloo (named).
* `slots_sweep`: `pdserve gpu-bench`'s sweep against HF static batching, cut at --sweep-seconds.

    pdserve gpu-check                      # cuda if present; JSON on stdout, progress on stderr
    pdserve gpu-check --device cpu --no-sweep --output check.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deploy.bench.baselines import copy_bandwidth
from deploy.bench.gpu_model import qwen3_config, word_level_tokenizer
from deploy.config import EngineConfig
from scheduler.request import Request, SamplingParams

FP32_LOGIT_TOLERANCE = 1e-3
# |Δ log p| nats, mean and worst, that bf16 may move a token's log-prob (docs/BENCHMARKING.md)
BF16_LOGPROB_LIMITS = (0.05, 0.3)
# ours against fp32 over transformers' bf16 against fp32 (mean, worst), as tests/workers/test_bf16
BF16_MEAN_FACTOR, BF16_MAX_FACTOR = 1.2, 1.5


def peaked_checkpoint(root: Path) -> Path:
    """A two-layer Qwen3-shaped model whose weights are spread wide (initializer_range 0.25), so
    its argmax has clear margins: greedy tokens do not flip on last-bit differences."""
    from transformers import AutoModelForCausalLM

    path = root / "peaked-qwen3"
    if (path / "config.json").exists():
        return path
    config = qwen3_config("tiny")
    config.initializer_range = 0.25
    torch.manual_seed(1234)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    word_level_tokenizer(config.vocab_size, config.eos_token_id).save_pretrained(path)
    return path


def _prompt(length: int, seed: int, vocab: int = 500) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=generator).tolist()


def _forward(model: Any, cache: Any, rows: list[tuple[int, list[int], int]], decode: int) -> Any:
    """rows: (request index, token ids, start); request i owns blocks 16i..16i+15."""
    from workers.model import BatchLayout

    tables = [(list(range(16 * i, 16 * i + 16)), ids, start) for i, ids, start in rows]
    input_ids, layout = BatchLayout.pack(tables, decode, 16, cache.k.device)
    return model(input_ids, layout, cache, torch.arange(len(input_ids), device=cache.k.device))


def check_versions(device: str) -> dict[str, Any]:
    import ray
    import transformers

    from workers import kernels

    line: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "ray": ray.__version__,
        "device": device,
    }
    try:
        import nixl._api  # noqa: F401

        line["nixl"] = "installed"
    except ImportError as error:
        line["nixl"] = f"missing ({error})"
    if device.startswith("cuda"):
        line["gpu"] = torch.cuda.get_device_name(device)
        line["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        line["sdpa_backends"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
        line["attention"] = "prompts: torch SDPA over gathered blocks; decode: gather + SDPA"
    else:
        built = kernels.load_kernels() is not None
        line["attention"] = (
            "C++ paged kernels (prompts and decode)" if built else "torch SDPA (no compiler)"
        )
    line["ok"] = True
    return line


def check_logits_fp32(checkpoint: Path, device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from workers.kv_cache import PagedKVCache
    from workers.loader import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    model = load_model(str(checkpoint), "float32", device).model
    spec = model.spec
    cache = PagedKVCache(
        spec.num_layers, 64, spec.num_kv_heads, 16, spec.head_dim, torch.float32, device
    )
    a, b = _prompt(40, 1), _prompt(23, 2)
    with torch.no_grad():
        ref_a = hf(torch.tensor([a], device=device)).logits[0]
        ref_b = hf(torch.tensor([b], device=device)).logits[0]
    diffs = []
    out = _forward(model, cache, [(0, a[:16], 0), (1, b[:20], 0)], 0)
    diffs += [(out[:16] - ref_a[:16]).abs().max(), (out[16:] - ref_b[:20]).abs().max()]
    out = _forward(model, cache, [(0, a[16:36], 16)], 0)
    diffs.append((out - ref_a[16:36]).abs().max())
    for step in range(3):
        rows = [(0, [a[36 + step]], 36 + step), (1, [b[20 + step]], 20 + step)]
        out = _forward(model, cache, rows, 2)
        diffs += [(out[0] - ref_a[36 + step]).abs().max(), (out[1] - ref_b[20 + step]).abs().max()]
    worst = max(float(d) for d in diffs)
    return {"max_abs_logit_diff": worst, "limit": FP32_LOGIT_TOLERANCE, "ok": worst <= 1e-3}


def _bf16_subject(root: Path, device: str) -> tuple[str, list[int]]:
    """The model and prompt of the bf16 check: the embedded SmolLM2 and a chat prompt where its
    package is installed; else gpu-bench's random-weight Qwen3-0.6B (its tiny preset on a CPU) and
    a random prompt: a machine with no package registry may lack the 98 MB GGUF."""
    from workers.catalog import DEFAULT_MODEL
    from workers.loader import load_tokenizer, resolve_checkpoint

    try:
        directory = resolve_checkpoint(DEFAULT_MODEL)
    except FileNotFoundError:
        from deploy.bench.gpu_model import build_checkpoint

        preset = "qwen3-0.6b" if device.startswith("cuda") else "tiny"
        path = build_checkpoint(preset, torch.bfloat16, device, 0, root)
        return str(path), _prompt(48, 5)
    tokenizer = load_tokenizer(DEFAULT_MODEL).tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Why is the sky blue? Answer in two sentences."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return directory, tokenizer(text).input_ids


def check_logprobs_bf16(root: Path, device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from workers.kv_cache import PagedKVCache
    from workers.loader import load_model

    directory, prompt = _bf16_subject(root, device)
    loaded = load_model(directory, "bfloat16", device)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    with torch.no_grad():  # the reference's own greedy reply, as tests/workers/test_bf16.py
        ids = hf.generate(
            torch.tensor([prompt], device=device), max_new_tokens=24, do_sample=False
        )[0].tolist()
        theirs = hf(torch.tensor([ids], device=device)).logits[0].float()
        exact = hf32(torch.tensor([ids], device=device)).logits[0]
    del hf, hf32
    spec = loaded.model.spec
    cache = PagedKVCache(
        spec.num_layers, 64, spec.num_kv_heads, 16, spec.head_dim, torch.bfloat16, device
    )
    # the prompt in chunks of 16, then the reply teacher-forced one decode step at a time
    steps = [([(0, prompt[s : s + 16], s)], 0) for s in range(0, len(prompt), 16)]
    steps += [([(0, [ids[p]], p)], 1) for p in range(len(prompt), len(ids) - 1)]
    ours = torch.cat([_forward(loaded.model, cache, rows, decode) for rows, decode in steps])
    targets = torch.tensor(ids[1:], device=device)

    def logp(logits: torch.Tensor) -> torch.Tensor:  # of each next token
        return logits.float().log_softmax(-1).gather(1, targets[:, None])[:, 0]

    ours_error = (logp(ours) - logp(exact[:-1])).abs()
    their_error = (logp(theirs[:-1]) - logp(exact[:-1])).abs()
    mean, worst = float(ours_error.mean()), float(ours_error.max())
    limits = [
        BF16_MEAN_FACTOR * float(their_error.mean()),
        BF16_MAX_FACTOR * float(their_error.max()),
    ]
    return {
        "model": Path(directory).name,
        "tokens": len(ids),
        "mean_abs_dlogp": mean,  # against the fp32 model
        "max_abs_dlogp": worst,
        "transformers_bf16": [float(their_error.mean()), float(their_error.max())],
        "limits": limits,
        "ok": mean <= limits[0] and worst <= limits[1],
    }


def _requests(count: int, max_tokens: int, sampling: SamplingParams | None = None) -> list[Any]:
    return [
        Request(f"r{i}", _prompt(5 + 9 * i, 10 + i), max_tokens, sampling or SamplingParams())
        for i in range(count)
    ]


def _engine_results(
    checkpoint: Path,
    device: str,
    requests: list[Any],
    probe: Callable[[Any], Any] | None = None,
    **overrides: Any,
) -> tuple[dict[str, Any], Any]:
    """The completions of a local engine (fp32, 8 slots unless `overrides` say otherwise) and what
    `probe(engine)` returns, called after the run while the engine is still open."""
    from deploy.driver import open_engine

    fields = {"model": str(checkpoint), "device": device, "dtype": "float32"}
    config = EngineConfig(**(fields | {"slots": 8, "max_model_len": 256} | overrides))
    with open_engine(config) as engine:
        results = engine.run(requests)
        return results, None if probe is None else probe(engine)


def _engine_tokens(
    checkpoint: Path, device: str, requests: list[Any], **overrides: Any
) -> dict[str, list[int]]:
    results, _ = _engine_results(checkpoint, device, requests, **overrides)
    return {r: c.token_ids for r, c in results.items()}


def check_greedy(checkpoint: Path, device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    requests = _requests(6, 24)
    batched = _engine_tokens(checkpoint, device, requests)
    solo = {}
    for request in _requests(6, 24):
        solo |= _engine_tokens(checkpoint, device, [request])
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    mismatched = []
    for request in requests:
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([request.prompt_ids], device=device),
                max_new_tokens=request.max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(request.prompt_ids) :].tolist()
        if batched[request.req_id] != ref:
            mismatched.append(request.req_id)
    solo_differs = [r for r in batched if batched[r] != solo[r]]
    return {
        "requests": len(requests),
        "differ_from_transformers": mismatched,
        "batched_differ_from_solo": solo_differs,
        "ok": not mismatched and not solo_differs,
    }


def check_quantized(checkpoint: Path, device: str) -> dict[str, Any]:
    from workers.kv_cache import PagedKVCache
    from workers.loader import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    packed = load_model(str(checkpoint), "float32", device, quantization="int8").model
    reference = _dequantized_twin(packed, str(checkpoint), "float32", device)
    spec = packed.spec
    errors = []
    for prompt in (_prompt(40, 1), _prompt(23, 2)):
        out = []
        for model in (packed, reference):
            cache = PagedKVCache(
                spec.num_layers, 16, spec.num_kv_heads, 16, spec.head_dim, torch.float32, device
            )
            with torch.no_grad():
                out.append(_forward(model, cache, [(0, prompt, 0)], 0))
        errors.append(float((out[0] - out[1]).norm() / out[1].norm()))
    limit = 1e-3 if device.startswith("cuda") else 0.06
    fp8_error = _fp8_logit_error(checkpoint, device) if device.startswith("cuda") else None
    requests = _requests(6, 24)
    batched = _engine_tokens(checkpoint, device, requests, quantization="int8")
    solo: dict[str, list[int]] = {}
    for request in _requests(6, 24):
        solo |= _engine_tokens(checkpoint, device, [request], quantization="int8")
    solo_differs = [r for r in batched if batched[r] != solo[r]]
    return {
        "relative_logit_error": max(errors),
        "limit": limit,
        "fp8_relative_logit_error": fp8_error,
        "batched_differ_from_solo": solo_differs,
        "ok": max(errors) <= limit and not solo_differs and (fp8_error is None or fp8_error < 0.1),
    }


def _dequantized_twin(model: Any, checkpoint: str, dtype: str, device: str) -> Any:
    """The checkpoint's float model with each of `model`'s quantized matrices dequantized in."""
    from workers.loader import load_model
    from workers.quantized import QUANTIZED

    reference = load_model(checkpoint, dtype, device).model
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, QUANTIZED):
                reference.get_submodule(name).weight.copy_(weight.dequantize())
    return reference


def _fp8_logit_error(checkpoint: Path, device: str) -> float:
    """`--quantization fp8` in bf16 against a bf16 model of the same FP8 values dequantized: the
    relative logit error of the activations' FP8 rounding and the scaled matmul."""
    from workers.kv_cache import PagedKVCache
    from workers.loader import load_model

    fp8 = load_model(str(checkpoint), "bfloat16", device, quantization="fp8").model
    reference = _dequantized_twin(fp8, str(checkpoint), "bfloat16", device)
    spec = fp8.spec
    out = []
    for model in (fp8, reference):
        cache = PagedKVCache(
            spec.num_layers, 16, spec.num_kv_heads, 16, spec.head_dim, torch.bfloat16, device
        )
        with torch.no_grad():
            out.append(_forward(model, cache, [(0, _prompt(40, 1), 0)], 0).float())
    return float((out[0] - out[1]).norm() / out[1].norm())


SAMPLING_OPTIONS: dict[str, dict[str, Any]] = {
    "temperature": {"temperature": 0.8, "seed": 7},
    "top_p": {"temperature": 1.0, "top_p": 0.5, "seed": 7},
    "top_k": {"temperature": 1.0, "top_k": 5, "seed": 7},
    "min_p": {"temperature": 1.0, "min_p": 0.2, "seed": 7},
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 1.5},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "min_tokens": {"min_tokens": 6},
    "logit_bias": {"logit_bias": ((42, 100.0),)},
    "logprobs": {"logprobs": 3},
}


def check_sampling(checkpoint: Path, device: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, options in SAMPLING_OPTIONS.items():
        sampling = SamplingParams(**options)
        first = _engine_tokens(checkpoint, device, _requests(3, 8, sampling))
        again = _engine_tokens(checkpoint, device, _requests(3, 8, sampling))
        ok = first == again and all(len(t) == 8 for t in first.values())
        if name == "logit_bias":  # +100 on one token: every sample is that token
            ok = ok and all(set(t) == {42} for t in first.values())
        results[name] = ok
    return {"options": results, "ok": all(results.values())}


def check_kv_transports(device: str) -> dict[str, Any]:
    import ray

    from deploy.ray_cell import init_ray
    from workers.kv_transfer import TRANSPORTS, usable_transports

    init_ray(EngineConfig(device=device))
    dev = torch.device(device)
    usable = usable_transports(dev, "nixl")
    size = (256 if dev.type == "cuda" else 32) * 2**20
    lines: dict[str, Any] = {}
    for name in TRANSPORTS:
        if usable.get(name):
            lines[name] = {"skipped": usable[name]}
            continue
        lines[name] = _round_trip(ray, name, device, size)
        if name != "object_store" and lines[name]["carried_by"] != [name]:
            lines[name]["exact"] = False  # (fell back to the object store)
    copy = copy_bandwidth(size, device)
    ok = all(line.get("exact", True) for line in lines.values())
    return {"payload_bytes": size, "copy_gb_s": copy, "transports": lines, "ok": ok}


class _KVSide:
    """One end of a round trip: a KV cache of `size` bytes' worth of tokens on the device."""

    def __init__(self, device: str, size: int) -> None:
        from workers.kv_cache import PagedKVCache

        tokens = max(16, size // PagedKVCache.bytes_per_token(4, 8, 128, torch.float32))
        self.table = list(range(tokens // 16))
        self.cache = PagedKVCache(4, len(self.table), 8, 16, 128, torch.float32, device)
        self.tokens = len(self.table) * 16

    def send(self, name: str, seed: int) -> tuple[list[Any], str]:
        from workers.kv_transfer import KVSender, make_transport

        generator = torch.Generator().manual_seed(seed)
        self.cache.k.copy_(torch.randn(self.cache.k.shape, generator=generator))
        self.cache.v.copy_(torch.randn(self.cache.v.shape, generator=generator))
        transport = make_transport(name, self.cache.k.device, 2 * self.cache.total_bytes)
        pieces = KVSender(self.cache, transport).export([("kv", self.table, 0, self.tokens)])
        return pieces, _digest(self.cache)

    def receive(self, pieces: list[Any]) -> dict[str, Any]:
        from scheduler.messages import KVHandoff, KVImport
        from workers.kv_transfer import KVReceiver

        handoff = KVImport(self.table, KVHandoff("kv", tuple(pieces), 0))
        start = time.perf_counter()
        report = KVReceiver(self.cache).import_all([handoff])
        seconds = time.perf_counter() - start
        fetched = sum(c.bytes for c in report.transfers.values())
        return {"failed": report.failed, "seconds": seconds, "bytes": fetched} | {
            "digest": _digest(self.cache)
        }


def _digest(cache: Any) -> str:
    import hashlib

    digest = hashlib.sha256()
    for tensor in (cache.k, cache.v):
        digest.update(tensor.cpu().numpy().tobytes())
    return digest.hexdigest()


def _round_trip(ray: Any, name: str, device: str, size: int) -> dict[str, Any]:
    """Rows put by one actor and imported by another (half a GPU each: one GPU for CUDA IPC):
    exact, and GB/s of fetch + copy in (2 x bytes / seconds, the copy convention)."""
    gpus = 0.5 if device.startswith("cuda") else 0
    side = ray.remote(num_cpus=0, num_gpus=gpus)(_KVSide)
    sender, receiver = side.remote(device, size), side.remote(device, size)
    try:
        pieces, digest = ray.get(sender.send.remote(name, seed=3))
        ray.get(receiver.receive.remote(pieces))  # warm: agents connect, memory registers
        line = ray.get(receiver.receive.remote(pieces))
    finally:
        ray.kill(sender)
        ray.kill(receiver)
    exact = not line["failed"] and line.pop("digest") == digest
    gb_s = 2 * line["bytes"] / max(line["seconds"], 1e-9) / 1e9
    return (
        line
        | {"carried_by": sorted({p.transport for p in pieces}), "gb_s": gb_s}
        | {"exact": exact}
    )


def check_disaggregated(checkpoint: Path, device: str) -> dict[str, Any]:
    from deploy.driver import RayEngine

    requests = _requests(6, 16)
    local = _engine_tokens(checkpoint, device, requests)
    gpus = 0.5 if device.startswith("cuda") else None
    config = EngineConfig(
        model=str(checkpoint),
        mode="disaggregated",
        device=device,
        dtype="float32",
        slots=8,
        max_model_len=256,
        gpus_per_worker=gpus,
    )
    with RayEngine(config) as engine:
        got = {r: c.token_ids for r, c in engine.run(_requests(6, 16)).items()}
        stats = engine.stats()
    transfers = {
        name: line | {"gb_s": 2 * line["bytes"] / max(line["seconds"], 1e-9) / 1e9}
        for name, line in stats["kv_transfer"].items()
    }
    differ = [r for r in local if local[r] != got[r]]
    return {"differ_from_local": differ, "kv_transfer": transfers, "ok": not differ}


def check_graphs(checkpoint: Path, device: str) -> dict[str, Any]:
    """CUDA graphs against `enforce_eager`: greedy tokens equal in fp32, log-probs within bf16's
    limits in bf16, and a replayed decode step without a host sync. Skipped on a CPU, where the
    runner captures no graphs (there is no padded decode path to compare), and on a build without
    `enforce_eager`."""
    if "enforce_eager" not in EngineConfig.model_fields:
        return {"ok": True, "skipped": "EngineConfig has no enforce_eager: no CUDA graphs here"}
    if not device.startswith("cuda"):
        _, probe = _engine_results(checkpoint, device, _requests(1, 2), _probe_graphs)
        if probe is not None:
            return {"ok": False, "error": "the runner captured decode graphs on a CPU"}
        return {"ok": True, "skipped": "CUDA graphs need a GPU: runner.graphs is None on cpu"}
    graphed, probe = _engine_results(checkpoint, device, _requests(6, 24), _probe_graphs)
    eager = _engine_tokens(checkpoint, device, _requests(6, 24), enforce_eager=True)
    if probe is None:
        return {"ok": False, "error": "the engine captured no decode graphs on cuda"}
    differ = [r for r in eager if eager[r] != graphed[r].token_ids]
    logprobs = _bf16_logprob_error(checkpoint, device)
    within = (
        logprobs["mean"] <= BF16_LOGPROB_LIMITS[0] and logprobs["max"] <= BF16_LOGPROB_LIMITS[1]
    )
    return probe | {
        "fp32_greedy_differ": differ,
        "bf16_logprobs": logprobs,
        "bf16_limits": BF16_LOGPROB_LIMITS,
        "ok": not differ
        and within
        and probe["host_sync_in_replay"] is None
        and probe["replay_vs_eager_max_abs"] <= FP32_LOGIT_TOLERANCE,
    }


def _probe_graphs(engine: Any) -> dict[str, Any] | None:
    """`probe_decode_graphs` of a local engine's runner."""
    return probe_decode_graphs(engine.engine.runner)


def probe_decode_graphs(runner: Any) -> dict[str, Any] | None:
    """A runner's decode graphs (None if it has none): how many, their capture time, a replay of
    up to three decode rows against the eager forward of the same rows and, on a GPU, whether
    that replay synchronizes with the host (`torch.cuda.set_sync_debug_mode("error")` raises if
    it does)."""
    from workers.model import BatchLayout

    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        return None
    count = min(3, max(graphs.buckets))
    rows = [(list(range(2 * i, 2 * i + 2)), 7 + i, 20 + i) for i in range(count)]
    gpu = runner.device.type == "cuda"
    graphs.run(rows)  # warm: the first replay may allocate
    synced = None
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        replayed = graphs.run(rows)
    except RuntimeError as error:
        if not gpu:
            raise
        synced = str(error)
    finally:
        if gpu:
            torch.cuda.set_sync_debug_mode("default")
    if synced is not None:
        replayed = graphs.run(rows)
    packed = [(table, [token], position) for table, token, position in rows]
    ids, layout = BatchLayout.pack(packed, count, runner.cache.block_size, runner.device)
    eager = runner.model(ids, layout, runner.cache, torch.arange(count, device=runner.device))
    return {
        "graphs": len(graphs.buckets),
        "buckets": list(graphs.buckets),
        "capture_seconds": graphs.capture_seconds,
        "capture_within_30s": graphs.capture_seconds <= 30,
        "sync_checked": gpu,
        "host_sync_in_replay": synced,
        "replay_vs_eager_max_abs": float((replayed[:count] - eager).abs().max()),
    }


def _bf16_logprob_error(checkpoint: Path, device: str) -> dict[str, Any]:
    """|Δ log p| of the sampled tokens between graphs and eager in bf16, over each request's
    tokens up to where the two first pick differently (bf16 may flip a close argmax)."""
    sampling = SamplingParams(logprobs=1)
    runs = [
        _engine_results(
            checkpoint, device, _requests(6, 24, sampling), dtype="bfloat16", **overrides
        )[0]
        for overrides in ({}, {"enforce_eager": True})
    ]
    errors = []
    diverged = []
    for req_id, graphed in runs[0].items():
        eager = runs[1][req_id]
        same = 0
        while same < len(eager.token_ids) and eager.token_ids[same] == graphed.token_ids[same]:
            same += 1
        if same < len(eager.token_ids):
            diverged.append(req_id)
        pairs = zip(graphed.logprobs[:same], eager.logprobs[:same], strict=True)
        errors += [abs(a.logprob - b.logprob) for a, b in pairs]
    if not errors:  # every request's first token differs: nothing to compare, a failure
        return {"mean": float("inf"), "max": float("inf"), "diverged": diverged}
    return {"mean": sum(errors) / len(errors), "max": max(errors), "diverged": diverged}


def check_tp_handoff(checkpoint: Path, device: str) -> dict[str, Any]:
    """A disaggregated TP-1 prefill -> TP-2 decode run gives TP-1 local mode's tokens. On one GPU
    its three ranks share the device: NCCL if it takes two ranks on one GPU (probed first), else
    gloo over the CUDA tensors; a CPU runs gloo. The line says which backend ran."""
    requests = _requests(4, 12)
    local = _engine_tokens(checkpoint, device, requests)
    refused = None
    backend = "gloo"
    if device.startswith("cuda"):
        refused = _nccl_refuses_shared_gpu()
        backend = "gloo" if refused else "nccl"
    results = _tp_disaggregated(checkpoint, device, _requests(4, 12), backend)
    differ = [r for r in local if local[r] != results[r].token_ids]
    handed = {r: c.metrics.get("kv_handoff_bytes", 0) for r, c in results.items()}
    return {
        "backend": backend,
        "nccl_refused": refused,
        "differ_from_local": differ,
        "kv_handoff_bytes": handed,
        "ok": not differ and any(handed.values()),
    }


def _tp_disaggregated(checkpoint: Path, device: str, requests: list[Any], backend: str) -> Any:
    """1 prefill worker of TP-1 and 1 decode worker of TP-2, a third of the GPU per rank; with
    gloo on a GPU, in a Ray whose workers start with `PDSERVE_TP_BACKEND=gloo`."""
    import ray

    from deploy.driver import RayEngine

    gpu = device.startswith("cuda")
    config = EngineConfig(
        model=str(checkpoint),
        mode="disaggregated",
        device=device,
        dtype="float32",
        slots=8,
        max_model_len=256,
        decode_tensor_parallel_size=2,
        gpus_per_worker=0.33 if gpu else None,
        # its three ranks fit a Ray of two logical CPUs (the one an earlier check started here)
        num_cpus_per_worker=0.5,
    )
    hooked = gpu and backend == "gloo"
    if hooked:
        ray.shutdown()
        ray.init(
            address="local",
            num_cpus=max(4, os.cpu_count() or 1),
            include_dashboard=False,
            runtime_env={"env_vars": {"PDSERVE_TP_BACKEND": "gloo"}},
        )
    try:
        with RayEngine(config) as engine:
            return engine.run(requests)
    finally:
        if hooked:
            ray.shutdown()  # the next check starts a Ray of its own, on the default backend


def _nccl_refuses_shared_gpu(timeout_s: float = 60.0) -> str | None:
    """Two processes on GPU 0 join an NCCL group and all-reduce: None if it works, else why not
    (NCCL reports a duplicate GPU, or the pair did not finish in `timeout_s`)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    errors = context.Queue()
    ranks = [context.Process(target=_nccl_rank, args=(port, rank, errors)) for rank in range(2)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [process for process in ranks if process.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    reasons = []
    while True:  # (a queue's empty() may not yet see what an exited process put)
        try:
            reasons.append(errors.get(timeout=0.5))
        except queue.Empty:
            break
    if hung:
        reasons.append(f"the two ranks did not finish in {timeout_s:.0f}s")
    if any(process.exitcode for process in ranks) and not reasons:
        reasons.append(f"exit codes {[process.exitcode for process in ranks]}")
    return "; ".join(reasons)[:500] or None


def _nccl_rank(port: int, rank: int, errors: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        x = torch.ones(4, device="cuda:0")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        if float(x[0]) != 2.0:
            errors.put(f"rank {rank}: all-reduce gave {float(x[0])}")
        dist.destroy_process_group()
    except Exception as error:
        errors.put(f"rank {rank}: {type(error).__name__}: {error}")


def check_slots_sweep(root: Path, device: str, seconds: float) -> dict[str, Any]:
    from deploy.bench.arguments import add_gpu_bench_arguments
    from deploy.bench.gpu import run_gpu_bench

    parser = argparse.ArgumentParser()
    add_gpu_bench_arguments(parser)
    preset = "qwen3-0.6b" if device.startswith("cuda") else "tiny"
    args = parser.parse_args(
        ["--device", device, "--preset", preset, "--time-limit", str(seconds)]
        + ["--roofline-seconds", "0"]
        + ["--workdir", str(root), "--output", str(root / "gpu_bench.jsonl")]
    )
    lines = run_gpu_bench(args)
    return {"lines": lines, "ok": bool(lines)}


def run_checks(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    checkpoint = peaked_checkpoint(root)
    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("versions", lambda: check_versions(device)),
        ("logits_fp32", lambda: check_logits_fp32(checkpoint, device)),
        ("logprobs_bf16", lambda: check_logprobs_bf16(root, device)),
        ("greedy", lambda: check_greedy(checkpoint, device)),
        ("sampling", lambda: check_sampling(checkpoint, device)),
        ("quantized", lambda: check_quantized(checkpoint, device)),
        ("kv_transports", lambda: check_kv_transports(device)),
        ("disaggregated", lambda: check_disaggregated(checkpoint, device)),
        ("graphs", lambda: check_graphs(checkpoint, device)),
        ("tp_handoff", lambda: check_tp_handoff(checkpoint, device)),
    ]
    if args.sweep_seconds > 0:
        checks.append(("slots_sweep", lambda: check_slots_sweep(root, device, args.sweep_seconds)))
    skip = set(args.skip or [])
    report: dict[str, Any] = {"device": device, "checks": {}}
    start = time.perf_counter()
    for name, check in checks:
        if name in skip:
            continue
        began = time.perf_counter()
        print(f"[{began - start:6.1f}s] {name} ...", file=sys.stderr, flush=True)
        try:
            line = check()
        except Exception as error:  # a check that breaks is a failed check; the rest still run
            line = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            traceback.print_exc(file=sys.stderr)
        line["seconds"] = round(time.perf_counter() - began, 2)
        report["checks"][name] = line
        verdict = "FAILED" if not line["ok"] else "skipped" if "skipped" in line else "ok"
        print(f"         {name}: {verdict}", file=sys.stderr, flush=True)
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["ok"] = all(line["ok"] for line in report["checks"].values())
    return report


def main(args: argparse.Namespace) -> int:
    report = run_checks(args)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if report["ok"] else 1

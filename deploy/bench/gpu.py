"""`pdserve gpu-bench`: a one-command, offline GPU benchmark: the roofline of random-weight model
shapes, then the local engine on a random-weight Qwen3-0.6B against `transformers`.

First the roofline (`deploy/bench/roofline.py`): decode steps against the bytes they must read at
the measured copy bandwidth, prefills against the measured matmul peak, one JSON line per point.
Then it builds a Qwen3-0.6B-shaped model with random weights (no network: config from code, weights
from a fixed seed, a word-level tokenizer over the vocabulary), saves it with `save_pretrained` and
loads it back through pdserve's own loader. Then, for each slot count of the sweep, it runs the same
workload (random prompts, all arriving at once, fixed output lengths) through the `local`-mode
engine and through `transformers`' static batching (`generate` on fixed batches of that many
requests), and reports throughput and each decode step's achieved memory bandwidth (weight + KV
bytes read per step / step time) as a fraction of the device's measured copy bandwidth. One JSON
line per slot count goes to stdout (and to --output) as it finishes, then a summary line; progress
and a final table go to stderr. The sweep stops early, and says so, when the next slot count would
not finish inside --time-limit, which bounds the whole run.

    python -m deploy.bench.gpu                                 # cuda if present, bf16, slots 1..64
    python -m deploy.bench.gpu --preset tiny --device cpu --slots 1,2,4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deploy.bench.arguments import add_gpu_bench_arguments
from deploy.bench.baselines import bench_static, copy_bandwidth, synchronize
from deploy.bench.gpu_model import build_checkpoint
from deploy.bench.roofline import (
    CPU_DECODE_GRID,
    CPU_PREFILL_GRID,
    DECODE_GRID,
    PREFILL_GRID,
    parse_grid,
    roofline_table,
    run_roofline,
    weight_bytes_read,
)
from deploy.bench.workload import make_workload
from deploy.config import EngineConfig
from scheduler.messages import Samples
from scheduler.plan import StepPlan
from scheduler.request import Request

# How bytes are counted: a decode step's bytes are what it reads (weights + KV), the issue's
# definition; the copy's are what it reads plus what it writes (2 x the tensor size), the usual
# convention for a device-to- device copy. A step that reads at the copy's full speed therefore
# scores about 1.0.
BYTES_CONVENTION = (
    "decode step: bytes read (weights + KV); copy: bytes read + bytes written (2 x size)"
)
KV_BYTES_MODEL = (
    "per decode-only step: K and V of every layer as workers/model.py reads them: on an "
    "accelerator "
    "the decode span (max slot - min slot + 1) x decode context (max position + 1), on CPU each "
    "decode row up to its own position; summed from the step plans, then averaged over decode "
    "steps (KV writes and activations not counted)"
)
WEIGHT_BYTES_MODEL = (
    "every parameter once per step (a tied embedding once, as the lm_head read) + the "
    "embedding rows looked up"
)
NOTES = {
    "bytes_convention": BYTES_CONVENTION,
    "weight_bytes_model": WEIGHT_BYTES_MODEL,
    "kv_bytes_model": KV_BYTES_MODEL,
    "decode_step_ms": (
        "whole engine step (plan, forward, sampling, update) over decode-only steps; the "
        "bandwidth uses it. decode_model_ms is the forward only, mostly launch time on cuda"
    ),
}


@dataclasses.dataclass
class DecodeTally:
    """What the decode-only steps read from the KV cache, taken from the plans the runner
    executes."""

    bytes_per_token: int  # K + V bytes of one position, all layers
    block_size: int
    # decode attention gathers every row's blocks up to the longest table (accelerators), else it
    # reads each row's own length
    batched: bool
    steps: int = 0
    tokens: int = 0
    padded: int = 0  # sum over steps of the positions the gathered tables hold per row
    context: int = 0  # sum over steps of the decode context (positions attended per row)
    kv_bytes: int = 0

    def record(self, plan: StepPlan) -> None:
        if not plan.decode or plan.prefill:
            return  # the engine's profile times decode-only steps; count the same ones
        padded = max(len(c.block_table) for c in plan.decode) * self.block_size
        context = max(c.start_pos for c in plan.decode) + 1
        self.steps += 1
        self.tokens += len(plan.decode)
        self.padded += padded
        self.context += context
        rows = len(plan.decode)
        positions = rows * padded if self.batched else sum(c.start_pos + 1 for c in plan.decode)
        self.kv_bytes += positions * self.bytes_per_token


def bench_engine(
    loaded: Any, config: EngineConfig, prompts: list[list[int]], output_len: int, device: str
) -> dict[str, Any]:
    """Warm up, then run the workload through a local engine; return throughput and decode-step
    numbers."""
    from deploy.driver import InProcessEngine
    from workers.kernels import load_kernels
    from workers.kv_cache import PagedKVCache

    engine = InProcessEngine(config, loaded).engine
    spec = loaded.model.spec
    tally = DecodeTally(
        PagedKVCache.bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, engine.runner.dtype
        ),
        engine.runner.cache.block_size,
        # each row up to its own length only with the CPU kernel; else the padded tables
        batched=engine.runner.device.type != "cpu" or load_kernels() is None,
    )
    execute = engine.runner.execute

    def counted_execute(plan: StepPlan) -> Samples:
        tally.record(plan)
        return execute(plan)

    warm = [
        Request(req_id=f"warm{i}", prompt_ids=p, max_tokens=min(4, output_len))
        for i, p in enumerate(prompts[: config.slots])
    ]
    engine.run(warm)
    engine.runner.execute = counted_execute  # type: ignore[method-assign]
    before = dict(engine.profile)
    steps_before = engine.num_steps
    requests = [
        Request(req_id=str(i), prompt_ids=p, max_tokens=output_len) for i, p in enumerate(prompts)
    ]
    try:
        synchronize(device)
        start = time.perf_counter()
        results = engine.run(requests)
        synchronize(device)
        elapsed = time.perf_counter() - start
    finally:
        # the wrapper holds the runner: drop the cycle so its KV cache frees at once
        del engine.runner.execute
    prof = {k: engine.profile[k] - before[k] for k in before}
    if prof["decode_steps"] != tally.steps:
        raise RuntimeError(
            f"profile counted {prof['decode_steps']} decode steps, the plans {tally.steps}"
        )
    tokens = sum(len(r.output_ids) for r in results.values())
    steps = max(tally.steps, 1)
    step_s = prof["decode_step_s"] / steps
    mean_tokens = tally.tokens / steps
    weights = weight_bytes_read(loaded.model, mean_tokens)
    kv = tally.kv_bytes / steps
    out = {
        "engine_tokens": tokens,
        "engine_s": elapsed,
        "engine_tok_s": tokens / elapsed,
        "engine_steps": engine.num_steps - steps_before,
        "decode_steps": tally.steps,
        "decode_step_ms": 1000 * step_s,
        # time inside the forward; on cuda kernels run asynchronously, so this is mostly launch time
        # (the step's sampling waits for them): use decode_step_ms for bandwidth
        "decode_model_ms": 1000 * prof["decode_model_s"] / steps,
        "decode_tok_s": tally.tokens / max(prof["decode_step_s"], 1e-12),
        "mean_decode_batch": mean_tokens,
        "mean_decode_padded_positions": tally.padded / steps,
        "mean_decode_context": tally.context / steps,
        "weight_bytes_per_step": weights,
        "kv_bytes_per_step": kv,
        "bytes_per_step": weights + kv,
        "achieved_gb_s": (weights + kv) / max(step_s, 1e-12) / 1e9,
    }
    del engine
    return out


def bench_static_warm(hf: Any, work: Any, batch_size: int) -> dict[str, Any]:
    """transformers' static batching (`bench_static`, which synchronizes the GPU) after one short
    untimed batch, as the engine gets a warm-up. Prompts have one length, so there is no padding."""
    with torch.inference_mode():
        ids = torch.tensor(work.prompts[:batch_size], device=hf.device)
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
        )
        out = bench_static(hf, work, batch_size)
    out.pop("static_batch")
    return out


def auto_token_budget(slots: int, prompt_len: int, prefill_chunk: int) -> int:
    """A budget that prefills every slot's next chunk in one step, so requests decode in lockstep
    and prefill is never starved: max(256, slots x min(prompt, chunk))."""
    return max(256, slots * min(prompt_len, prefill_chunk))


def _round(line: dict[str, Any]) -> dict[str, Any]:
    """Floats to 6 significant digits (a small bandwidth fraction keeps its digits)."""
    return {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in line.items()}


def _progress(start: float, message: str) -> None:
    print(f"[gpu-bench {time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)


def _emit(line: dict[str, Any], output: Path | None) -> None:
    """A result line to stdout and, with --output, to its file."""
    print(json.dumps(line), flush=True)
    if output is not None:
        with output.open("a") as f:
            f.write(json.dumps(line) + "\n")


def _roofline(
    args: argparse.Namespace, device: str, dtype: torch.dtype, copy_gb_s: float, start: float
) -> list[dict[str, Any]]:
    """The roofline's lines (`deploy/bench/roofline.py`), rounded; none if --roofline-seconds 0."""
    if args.roofline_seconds <= 0:
        return []
    gpu = device.startswith("cuda")
    shapes = args.roofline_shapes
    if shapes == "auto":
        shapes = "llama3-8b,qwen3-0.6b" if gpu else "tiny"
    decode = args.roofline_decode
    if decode == "auto":
        decode = DECODE_GRID if gpu else CPU_DECODE_GRID
    prefill = args.roofline_prefill
    if prefill == "auto":
        prefill = PREFILL_GRID if gpu else CPU_PREFILL_GRID
    lines = run_roofline(
        [s.strip() for s in shapes.split(",") if s.strip()],
        parse_grid(decode),
        [int(tokens) for tokens in prefill.split(",")],
        dtype,
        device,
        copy_gb_s,
        args.roofline_seconds,
        lambda message: _progress(start, message),
    )
    return [_round(line) for line in lines]


def _table(lines: list[dict[str, Any]]) -> str:
    header = (
        f"{'slots':>5} {'engine tok/s':>12} {'static tok/s':>12} {'x static':>8} {'step ms':>8} "
        f"{'GB/s':>9} {'of copy':>8}"
    )
    rows = [header] + [
        f"{ln['slots']:>5} {ln['engine_tok_s']:>12.1f} {ln['static_tok_s']:>12.1f} "
        f"{ln['x_static']:>8.2f} "
        f"{ln['decode_step_ms']:>8.2f} {ln['achieved_gb_s']:>9.2f} {ln['bandwidth_fraction']:>8.3f}"
        for ln in lines
    ]
    return "\n".join(rows)


def _fit_cost_model(
    args: argparse.Namespace, loaded: Any, device: str, start: float
) -> dict[str, Any]:
    from deploy.bench.cost_model import cost_model_json, fit_cost_model

    _progress(start, "timing the forward on the cost model's grid")
    label = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    cost, points = fit_cost_model(
        loaded,
        device,
        f"{label.lower().replace(' ', '-')}-{args.preset}",
        args.link_gb_s * 1e9,
        args.startup_s,
    )
    text = cost_model_json(cost, points)
    Path(args.fit_cost_model).parent.mkdir(parents=True, exist_ok=True)
    Path(args.fit_cost_model).write_text(text + "\n")
    for point in points:
        shape = (
            f"{point['tokens']} tokens after {point['cached']}"
            if point["kind"] == "prefill"
            else f"batch {point['batch']} x KV {point['kv_len']}"
        )
        _progress(
            start,
            f"{point['kind']:8} {shape:26} {point['s'] * 1e3:9.3f} ms, "
            f"fit {point['fit_s'] * 1e3:9.3f} ms",
        )
    _progress(start, f"wrote {args.fit_cost_model}")
    return json.loads(text)


def run_gpu_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the sweep; print and write one JSON line per slot count and a summary line; return them
    all."""
    import transformers
    from transformers import AutoModelForCausalLM

    from workers.loader import load_model, resolve_device, resolve_dtype

    start = time.perf_counter()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    slot_counts = [int(s) for s in str(args.slots).split(",") if s.strip()]
    if not slot_counts or min(slot_counts) < 1:
        raise ValueError(f"--slots must list positive integers, got {args.slots!r}")
    if args.prompt_len < 1 or args.output_len < 1:
        raise ValueError("--prompt-len and --output-len must be >= 1")
    copy_bytes = int((args.copy_mib or (1024 if device.startswith("cuda") else 128)) * 2**20)
    output = Path(args.output) if args.output else None
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text("")

    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-bench-") as tmp:
        root = Path(args.workdir) if args.workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        _progress(start, f"building the {args.preset} checkpoint ({dtype}, {device}) under {root}")
        checkpoint = build_checkpoint(args.preset, dtype, device, args.seed, root)
        _progress(start, "loading it through pdserve's loader")
        loaded = load_model(str(checkpoint), args.dtype, device)
        if args.fit_cost_model:
            return [_fit_cost_model(args, loaded, device, start)]
        _progress(start, f"measuring copy bandwidth ({copy_bytes / 2**20:.0f} MiB)")
        copy_gb_s = copy_bandwidth(copy_bytes, device)
        _progress(start, f"copy bandwidth {copy_gb_s:.1f} GB/s (read + write)")
        roofline = _roofline(args, device, dtype, copy_gb_s, start)
        for line in roofline:
            _emit(line, output)
        _progress(start, "loading it into transformers for the static-batching baseline")
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
        setup_s = time.perf_counter() - start
        _progress(start, f"setup (roofline included) took {setup_s:.1f}s")

        max_model_len = math.ceil((args.prompt_len + args.output_len) / 16) * 16
        head = {
            "record": "sweep",
            "preset": args.preset,
            "device": device,
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None),
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "max_model_len": max_model_len,
            "detokenize": args.detokenize,
            "model_params": sum(p.numel() for p in loaded.model.parameters()),
            "copy_gb_s": copy_gb_s,
            "bytes_convention": "step bytes read vs copy bytes read+written",
            # see NOTES
            "kv_bytes_model": "span x max context"
            if device != "cpu"
            else "each row to its position",
        }
        # Without --detokenize the engine gets no tokenizer: random ids make meaningless text, and
        # its per-token detokenization would add CPU time to the decode steps being measured.
        engine_model = loaded if args.detokenize else dataclasses.replace(loaded, tokenizer=None)
        lines: list[dict[str, Any]] = []
        skipped: list[int] = []
        last: tuple[int, float] | None = None
        for index, slots in enumerate(slot_counts):
            if last is not None:
                # conservative: a run's time grows at most linearly with the slot count
                projected = last[1] * max(1.0, slots / last[0])
                if time.perf_counter() - start + projected > args.time_limit:
                    skipped = slot_counts[index:]
                    _progress(
                        start,
                        f"stopping early: slots {slots} is projected to take {projected:.0f}s, "
                        f"past the {args.time_limit:.0f}s limit; skipping {skipped}",
                    )
                    break
            run_start = time.perf_counter()
            num_requests = max(args.min_requests, args.requests_per_slot * slots)
            work = make_workload(
                num_requests,
                str(args.prompt_len),
                str(args.output_len),
                loaded.model.spec.vocab_size,
                args.seed + slots,
            )
            chunk = (
                min(args.prefill_chunk, args.token_budget)
                if args.token_budget
                else args.prefill_chunk
            )
            budget = args.token_budget or auto_token_budget(slots, args.prompt_len, chunk)
            # random prompts share no prefix: a prefix cache would only add block copies to the
            # steps measured
            config = EngineConfig(
                model=str(checkpoint),
                mode="local",
                slots=slots,
                max_model_len=max_model_len,
                token_budget=budget,
                prefill_chunk=chunk,
                dtype=args.dtype,
                device=device,
                prefix_cache_tokens=0,
            )
            _progress(start, f"slots {slots}: engine, {num_requests} requests")
            line = head | {
                "slots": slots,
                "requests": num_requests,
                "requested_tokens": work.num_output_tokens,
                "token_budget": budget,
                "prefill_chunk": chunk,
            }
            line |= bench_engine(engine_model, config, work.prompts, args.output_len, device)
            _progress(start, f"slots {slots}: transformers static batching")
            line |= bench_static_warm(hf, work, slots)
            line |= {
                "x_static": line["engine_tok_s"] / line["static_tok_s"],
                "bandwidth_fraction": line["achieved_gb_s"] / copy_gb_s,
                "run_s": time.perf_counter() - run_start,
                "elapsed_s": time.perf_counter() - start,
            }
            if device.startswith("cuda"):
                line["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.empty_cache()
            line = _round(line)
            lines.append(line)
            last = (slots, line["run_s"])
            _emit(line, output)
        del hf, loaded, engine_model

    summary = _round(
        {
            "record": "summary",
            "preset": args.preset,
            "device": head["device_name"],
            "dtype": head["dtype"],
            "completed_slots": [ln["slots"] for ln in lines],
            "skipped_slots": skipped,
            "stopped_early": bool(skipped),
            "time_limit_s": args.time_limit,
            "setup_s": setup_s,
            "elapsed_s": time.perf_counter() - start,
            "copy_gb_s": copy_gb_s,
            "roofline_points": sum("skipped" not in ln for ln in roofline[:-1]),
            "roofline_skipped": sum("skipped" in ln for ln in roofline[:-1]),
            "notes": NOTES,
        }
    )
    _emit(summary, output)
    if roofline:
        print(roofline_table(roofline[:-1]), file=sys.stderr)
    print(_table(lines), file=sys.stderr)
    if skipped:
        print(
            f"stopped early at the {args.time_limit:.0f}s limit: slots {skipped} not run",
            file=sys.stderr,
        )
    print(
        f"copy bandwidth {copy_gb_s:.1f} GB/s (read + write); total {summary['elapsed_s']:.1f}s"
        + (f"; results in {output}" if output else ""),
        file=sys.stderr,
        flush=True,
    )
    return roofline + lines + [summary]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.bench.gpu",
        description="GPU benchmark of the local engine on a random-weight Qwen3-0.6B.",
    )
    add_gpu_bench_arguments(parser)
    run_gpu_bench(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`pdserve bench`: the engine against serial and static-batch `transformers.generate`, in one run."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from deploy.bench_stats import goodput, percentile, summarize
from deploy.config import EngineConfig
from scheduler.outputs import Completion
from scheduler.request import Request, SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrival_s: list[float]  # offsets from the start (all 0: everything at once)
    urgent: list[bool]  # urgent requests get priority 0, the others 1 (when priorities are on)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def parse_range(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' with 1 <= MIN <= MAX."""
    parts = [int(p) for p in text.split(":")]
    low, high = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    if len(parts) > 2 or not 1 <= low <= high:
        raise ValueError(f"bad length range {text!r}: use N or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def make_workload(num_requests: int, prompt_len: str, output_len: str, vocab_size: int, seed: int,
                  rate: float = 0.0, urgent_fraction: float = 0.0) -> Workload:
    """Random-token prompts and output lengths drawn uniformly from the ranges, Poisson arrivals at
    `rate` requests/s (0: all at once) and a random `urgent_fraction` of urgent requests, reproducibly."""
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = parse_range(prompt_len), parse_range(output_len)
    low_id = min(100, vocab_size // 4)  # keep clear of the special tokens at the start of most vocabularies
    prompts = [[rng.randrange(low_id, vocab_size) for _ in range(rng.randint(p_lo, p_hi))]
               for _ in range(num_requests)]
    output_lens = [rng.randint(o_lo, o_hi) for _ in range(num_requests)]
    arrivals, t = [], 0.0
    for _ in range(num_requests):
        arrivals.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    urgent = [rng.random() < urgent_fraction for _ in range(num_requests)]
    return Workload(prompts, output_lens, arrivals, urgent)


def bench_serial(hf: Any, work: Workload, limit: int) -> dict[str, float]:
    """One request at a time through `generate` (greedy, exact output lengths)."""
    tokens, start = 0, time.perf_counter()
    for prompt, n in list(zip(work.prompts, work.output_lens, strict=True))[:limit]:
        ids = torch.tensor([prompt])
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0)
        tokens += n
    elapsed = time.perf_counter() - start
    return {"serial_tok_s": tokens / elapsed, "serial_requests": min(limit, len(work.prompts))}


def bench_static(hf: Any, work: Workload, batch_size: int) -> dict[str, float]:
    """Fixed batches of `batch_size`, left-padded, each running until its longest output is done:
    only the tokens each request asked for count as useful."""
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts, lens = work.prompts[i : i + batch_size], work.output_lens[i : i + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        hf.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                    do_sample=False, pad_token_id=0)
    return {"static_tok_s": work.num_output_tokens / (time.perf_counter() - start)}


def _requests(work: Workload, priorities: bool) -> list[Request]:
    return [Request(req_id=str(i), prompt_ids=p, max_tokens=n, sampling=SamplingParams(),
                    priority=0 if (urgent or not priorities) else 1)
            for i, (p, n, urgent) in enumerate(zip(work.prompts, work.output_lens, work.urgent, strict=True))]


def bench_mode(config: EngineConfig, loaded: Any, work: Workload, sequential: bool = False,
               priorities: bool = True, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
               ) -> tuple[dict[str, Any], list[dict]]:
    """Run the workload through one mode: at its arrival times, or one request at a time
    (`sequential`, the low-load case). Returns a summary line and per-request lines."""
    requests = _requests(work, priorities)
    batches = [[r] for r in requests] if sequential else [requests]
    arrivals = None if sequential else {str(i): t for i, t in enumerate(work.arrival_s)}
    summary: dict[str, Any] = {"mode": config.mode, "slots": config.slots, "token_budget": config.token_budget,
                               "prefill_chunk": config.prefill_chunk, "sequential": sequential,
                               "priorities": priorities}
    results: dict[str, Completion] = {}
    if config.mode == "local":
        from deploy.engine_factory import build_local_engine

        engine, _ = build_local_engine(config, loaded)
        start = time.perf_counter()
        for batch in batches:
            results |= {k: Completion.from_request(r) for k, r in engine.run(batch, arrival_s=arrivals).items()}
        elapsed = time.perf_counter() - start
        prof = engine.profile
        summary |= {"engine_steps": engine.num_steps,
                    "model_fraction": prof["model_s"] / max(prof["step_s"], 1e-9),
                    "decode_steps": prof["decode_steps"],
                    "decode_step_ms": 1000 * prof["decode_step_s"] / max(prof["decode_steps"], 1),
                    "decode_model_fraction": prof["decode_model_s"] / max(prof["decode_step_s"], 1e-9)}
    else:
        import ray

        from deploy.ray_client import run_requests, start_scheduler

        handle = start_scheduler(config)
        try:
            start = time.perf_counter()
            for batch in batches:
                results |= run_requests(handle, batch, arrival_s=arrivals)
            elapsed = time.perf_counter() - start
        finally:
            ray.get(handle.shutdown.remote())
            ray.kill(handle)
        handoff_bytes = sum(c.metrics.get("kv_handoff_bytes", 0) for c in results.values())
        handoff_s = sum(c.metrics.get("kv_handoff_s", 0.0) for c in results.values())
        if handoff_bytes:
            summary |= {"handoff_mb_per_request": handoff_bytes / len(results) / 1e6,
                        "handoff_gb_s": handoff_bytes / handoff_s / 1e9}
    assert sum(len(c.token_ids) for c in results.values()) == work.num_output_tokens
    done = list(results.values())
    ttft_s = [c.metrics["ttft_s"] for c in done]
    tpot_s = [c.metrics["tpot_s"] for c in done]
    summary |= {"batched_tok_s": work.num_output_tokens / elapsed, "requests_per_s": len(done) / elapsed,
                "goodput_req_s": goodput(ttft_s, tpot_s, elapsed, slo_ttft_ms, slo_tpot_ms),
                "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
                "preemptions": sum(c.metrics.get("preemptions", 0) for c in done)}
    summary |= summarize("ttft_ms", [1000 * t for t in ttft_s])
    summary |= summarize("tpot_ms", [1000 * c.metrics["tpot_s"] for c in done if len(c.token_ids) > 1])
    summary |= summarize("e2e_ms", [1000 * c.metrics["e2e_s"] for c in done])
    for phase in ("queue", "prefill", "decode"):
        summary[f"{phase}_ms_mean"] = 1000 * sum(c.metrics.get(f"{phase}_s", 0.0) for c in done) / len(done)
    if any(work.urgent):
        for label, want in (("urgent", True), ("normal", False)):
            values = [1000 * results[str(i)].metrics["ttft_s"] for i, u in enumerate(work.urgent) if u == want]
            summary |= {f"{label}_ttft_ms_p50": percentile(values, 50),
                        f"{label}_ttft_ms_p99": percentile(values, 99)}
    per_request = [{"rid": r.req_id, "mode": config.mode, "slots": config.slots,
                    "ttft_ms": round(1000 * results[r.req_id].metrics["ttft_s"], 2),
                    "tpot_ms": round(1000 * results[r.req_id].metrics["tpot_s"], 2),
                    "tokens": len(results[r.req_id].token_ids), "finish": results[r.req_id].finish_reason}
                   for r in requests]
    return summary, per_request


def bench_copy(num_bytes: int, repeat: int = 5) -> float:
    """GB/s of a plain in-process copy into a preallocated tensor of the same size: the handoff's yardstick."""
    src = torch.ones(max(1, num_bytes // 4))
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    return num_bytes * repeat / (time.perf_counter() - start) / 1e9


def run_bench(config: EngineConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Print (and optionally write) JSON lines: one summary per engine run, then per-request lines."""
    from transformers import AutoModelForCausalLM

    from workers.loader import load_model, resolve_checkpoint

    loaded = load_model(config.model, config.dtype, config.device)
    work = make_workload(args.num_requests, args.prompt_len, args.output_len, loaded.model.spec.vocab_size,
                         args.seed, args.rate, args.urgent_fraction)
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    head: dict[str, Any] = {"model": config.model, "requests": len(work.prompts),
                            "output_tokens": work.num_output_tokens, "torch_threads": torch.get_num_threads()}
    if baselines:
        weight = loaded.model.output_weight()
        hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(config.model), dtype=weight.dtype)
        hf = hf.to(weight.device).eval()
        with torch.inference_mode():
            if "serial" in baselines:
                head |= bench_serial(hf, work, args.serial_requests)
            if "static" in baselines:
                head |= bench_static(hf, work, config.slots)
        del hf
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in head.items()}),
              file=sys.stderr, flush=True)
    slot_counts = [int(s) for s in args.sweep_slots.split(",")] if args.sweep_slots else [config.slots]
    modes = args.modes.split(",") if args.modes else [config.mode]
    lines: list[dict[str, Any]] = []
    runs = [(mode, slots, prio) for mode in modes for slots in slot_counts
            for prio in ((False, True) if args.compare_priorities else (True,))]
    for mode, slots, prio in runs:
        summary, per_request = bench_mode(config.model_copy(update={"slots": slots, "mode": mode}), loaded,
                                          work, sequential=args.sequential, priorities=prio,
                                          slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
        summary = head | summary
        for key in ("serial_tok_s", "static_tok_s"):
            if key in head:
                summary[f"x_{key.split('_')[0]}"] = summary["batched_tok_s"] / head[key]
        if "handoff_mb_per_request" in summary:
            copy = bench_copy(int(summary["handoff_mb_per_request"] * 1e6))
            summary |= {"copy_gb_s": copy, "handoff_vs_copy": summary["handoff_gb_s"] / copy}
        lines += [summary] + per_request
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}),
              flush=True)
    by_mode = {line["mode"]: line for line in lines if "rid" not in line}
    if "colocated" in by_mode and "disaggregated" in by_mode:
        ratio = by_mode["disaggregated"]["ttft_ms_mean"] / by_mode["colocated"]["ttft_ms_mean"]
        print(json.dumps({"ttft_disaggregated_over_colocated": round(ratio, 3)}), flush=True)
    for line in lines:
        if "rid" in line:
            print(json.dumps(line), file=sys.stderr if args.output else sys.stdout)
    if args.output:
        with open(args.output, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return lines

"""`pdserve bench`: serving figures of the engine (or a running endpoint) and `transformers` baselines in one run.

One run crosses every mode × slot count × token budget × arrival rate × priority setting asked for,
on the same prompts, and prints one JSON summary line per configuration (then per-request lines);
`--output` writes them all to a file and `--plot` draws the figure (deploy/bench_plot.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from deploy.bench_stats import goodput, percentile, summarize
from deploy.config import EngineConfig
from scheduler.outputs import Completion
from scheduler.request import Request, SamplingParams


class BenchFailed(RuntimeError):
    """A run produced no figures worth reporting: every request failed, or the engine cut requests short."""


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrival_s: list[float]  # offsets from the start (all 0: everything at once)
    urgent: list[bool]  # urgent requests get priority 0, the others 1 (when priorities are on)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def priorities(self, on: bool) -> list[int]:
        return [0 if (urgent or not on) else 1 for urgent in self.urgent]


def parse_range(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' with 1 <= MIN <= MAX."""
    parts = [int(p) for p in text.split(":")]
    low, high = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    if len(parts) > 2 or not 1 <= low <= high:
        raise ValueError(f"bad length range {text!r}: use N or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def parse_list(text: str | None, kind: type, name: str) -> list[Any]:
    """A comma list of numbers ('1,2,4'); a bad item names the flag."""
    try:
        return [kind(x) for x in (text or "").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected a comma list of numbers, got {text!r}") from None


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets of a Poisson process at `rate` requests/s (all 0 when rate is 0)."""
    if rate < 0:
        raise ValueError(f"rate must be >= 0, got {rate}")
    rng = random.Random(f"arrivals-{seed}")
    arrivals, t = [], 0.0
    for _ in range(num_requests):
        arrivals.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return arrivals


def make_workload(num_requests: int, prompt_len: str, output_len: str, vocab_size: int, seed: int,
                  rate: float = 0.0, urgent_fraction: float = 0.0) -> Workload:
    """Random-token prompts and output lengths drawn uniformly from the ranges, Poisson arrivals at
    `rate` requests/s (0: all at once) and a random `urgent_fraction` of urgent requests, reproducibly.
    The prompts and lengths depend only on the seed, not on the rate."""
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = parse_range(prompt_len), parse_range(output_len)
    low_id = min(100, vocab_size // 4)  # keep clear of the special tokens at the start of most vocabularies
    prompts = [[rng.randrange(low_id, vocab_size) for _ in range(rng.randint(p_lo, p_hi))]
               for _ in range(num_requests)]
    output_lens = [rng.randint(o_lo, o_hi) for _ in range(num_requests)]
    urgent = [rng.random() < urgent_fraction for _ in range(num_requests)]
    return Workload(prompts, output_lens, poisson_arrivals(num_requests, rate, seed), urgent)


def load_workload(path: str, tokenizer: Any, num_requests: int, output_len: str, seed: int,
                  urgent_fraction: float = 0.0) -> Workload:
    """Prompts from a JSONL file, one object per line with `prompt` (text), `messages` (chat) or
    `prompt_token_ids`, and optionally `max_tokens` (else drawn from `output_len`). The first
    `num_requests` lines are used (all if 0)."""
    from deploy.requests import encode_prompt

    rng = random.Random(seed)
    o_lo, o_hi = parse_range(output_len)
    prompts, output_lens = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if num_requests and len(prompts) == num_requests:
                break
            try:
                item = json.loads(line)
                fields = {k: item[k] for k in ("prompt", "messages", "prompt_token_ids") if k in item}
                prompts.append(encode_prompt(tokenizer, **fields))
                output_lens.append(int(item.get("max_tokens") or rng.randint(o_lo, o_hi)))
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    urgent = [rng.random() < urgent_fraction for _ in prompts]
    return Workload(prompts, output_lens, [0.0] * len(prompts), urgent)


def bench_serial(hf: Any, work: Workload, limit: int,
                 progress: Callable[[int], Any] | None = None) -> dict[str, float]:
    """One request at a time through `generate` (greedy, exact output lengths)."""
    tokens, start = 0, time.perf_counter()
    for prompt, n in list(zip(work.prompts, work.output_lens, strict=True))[:limit]:
        ids = torch.tensor([prompt])
        hf.generate(ids.to(hf.device), attention_mask=torch.ones_like(ids).to(hf.device), max_new_tokens=n,
                    min_new_tokens=n, do_sample=False, pad_token_id=0)
        tokens += n
        if progress:
            progress(1)
    elapsed = time.perf_counter() - start
    return {"serial_tok_s": tokens / elapsed, "serial_requests": min(limit, len(work.prompts))}


def bench_static(hf: Any, work: Workload, batch_size: int,
                 progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Fixed batches of `batch_size`, left-padded, each running until its longest output is done:
    only the tokens each request asked for count as useful (taken from what `generate` returned).
    Timed with the device synchronized, so it holds on a GPU too."""
    sync = torch.cuda.synchronize if hf.device.type == "cuda" else (lambda: None)
    sync()
    start, useful = time.perf_counter(), 0
    for i in range(0, len(work.prompts), batch_size):
        prompts, lens = work.prompts[i : i + batch_size], work.output_lens[i : i + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = hf.generate(ids.to(hf.device), attention_mask=mask.to(hf.device), max_new_tokens=max(lens),
                          min_new_tokens=max(lens), do_sample=False, pad_token_id=0)
        useful += sum(min(n, out.shape[1] - width) for n in lens)
        if progress:
            progress(len(prompts))
    sync()
    elapsed = time.perf_counter() - start
    return {"static_tok_s": useful / elapsed, "static_tokens": useful, "static_s": elapsed,
            "static_batch": batch_size}


def _requests(work: Workload, priorities: bool) -> list[Request]:
    return [Request(req_id=str(i), prompt_ids=p, max_tokens=n, sampling=SamplingParams(), priority=prio)
            for i, (p, n, prio) in enumerate(zip(work.prompts, work.output_lens, work.priorities(priorities),
                                                 strict=True))]


def _warmup_request(work: Workload) -> Request:
    """A short request run before the clock starts: first calls into torch (and fresh worker processes)
    are slower than every later one."""
    return Request(req_id="warmup", prompt_ids=work.prompts[0][:16], max_tokens=2)


def run_engine(config: EngineConfig, loaded: Any, work: Workload, sequential: bool, priorities: bool,
               on_finish: Callable[[Completion], None]) -> tuple[dict[str, Completion], float, dict[str, Any]]:
    """The workload through one engine mode, at its arrival times or one request at a time
    (`sequential`: the low-load case), after a warm-up request. Returns completions, wall seconds and
    mode-specific figures."""
    requests = _requests(work, priorities)
    batches = [[r] for r in requests] if sequential else [requests]
    arrivals = None if sequential else {str(i): t for i, t in enumerate(work.arrival_s)}
    results: dict[str, Completion] = {}
    extra: dict[str, Any] = {}
    if config.mode == "local":
        from deploy.engine_factory import build_local_engine

        engine, _ = build_local_engine(config, loaded)
        engine.run([_warmup_request(work)])
        engine.reset_profile()
        start = time.perf_counter()
        for batch in batches:
            finished = engine.run(batch, arrival_s=arrivals, on_finish=lambda r: on_finish(Completion.from_request(r)))
            results |= {k: Completion.from_request(r) for k, r in finished.items()}
        elapsed = time.perf_counter() - start
        prof = engine.profile
        extra = {"engine_steps": engine.num_steps,
                 "model_fraction": prof["model_s"] / max(prof["step_s"], 1e-9),
                 "decode_steps": prof["decode_steps"],
                 "decode_step_ms": 1000 * prof["decode_step_s"] / max(prof["decode_steps"], 1),
                 "decode_model_fraction": prof["decode_model_s"] / max(prof["decode_step_s"], 1e-9)}
        return results, elapsed, extra
    import ray

    from deploy.ray_client import run_requests, start_scheduler

    handle = start_scheduler(config)
    try:
        run_requests(handle, [_warmup_request(work)])
        start = time.perf_counter()
        for batch in batches:
            results |= run_requests(handle, batch, arrival_s=arrivals, on_finish=on_finish)
        elapsed = time.perf_counter() - start
    finally:
        ray.get(handle.shutdown.remote())
        ray.kill(handle)
    handoff_bytes = sum(c.metrics.get("kv_handoff_bytes", 0) for c in results.values())
    handoff_s = sum(c.metrics.get("kv_handoff_s", 0.0) for c in results.values())
    if handoff_bytes:
        extra = {"handoff_mb_per_request": handoff_bytes / len(results) / 1e6,
                 "handoff_gb_s": handoff_bytes / handoff_s / 1e9}
    return results, elapsed, extra


def summarize_run(work: Workload, results: dict[str, Completion], elapsed: float, slo_ttft_ms: float | None,
                  slo_tpot_ms: float | None, exact: bool = True) -> dict[str, Any]:
    """Throughput, goodput, and mean/p50/p90/p99 of TTFT, TPOT, inter-token latency and end-to-end latency
    over the requests that succeeded; failed ones are counted (and never count as good). With `exact`
    (the engine in process), a request that made fewer tokens than asked is a bug and raises; an endpoint
    that does not honour `ignore_eos` may stop early, and its real token counts are used."""
    every = [results[str(i)] for i in range(len(work.prompts))]
    failed = [c for c in every if c.error is not None or c.finish_reason in ("error", "abort")]
    done = [c for c in every if c.error is None and c.finish_reason not in ("error", "abort")]
    if not done:
        raise BenchFailed(f"every request failed, e.g. {failed[0].error or failed[0].finish_reason}")
    short = [(c.req_id, len(c.token_ids), work.output_lens[int(c.req_id)]) for c in done
             if len(c.token_ids) != work.output_lens[int(c.req_id)]]
    if short and exact:
        raise BenchFailed(f"requests ended early (id, tokens, asked): {short[:5]}; finish reasons: "
                           f"{sorted({str(c.finish_reason) for c in done})}")
    ttft_s = [c.metrics["ttft_s"] for c in done]
    tpot_s = [c.metrics["tpot_s"] for c in done]
    summary: dict[str, Any] = {
        "output_tok_s": sum(len(c.token_ids) for c in done) / elapsed, "requests_per_s": len(done) / elapsed,
        "duration_s": elapsed, "failed_requests": len(failed),
        "goodput_req_s": goodput(ttft_s, tpot_s, elapsed, slo_ttft_ms, slo_tpot_ms),
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
        "preemptions": sum(c.metrics.get("preemptions", 0) for c in done)}
    if failed:
        summary["failures"] = sorted({c.error or str(c.finish_reason) for c in failed})[:3]
    if short:
        summary["requests_ended_early"] = len(short)
    summary |= summarize("ttft_ms", [1000 * t for t in ttft_s])
    summary |= summarize("tpot_ms", [1000 * c.metrics["tpot_s"] for c in done if len(c.token_ids) > 1])
    summary |= summarize("itl_ms", [1000 * gap for c in done for gap in c.inter_token_s()])
    summary |= summarize("e2e_ms", [1000 * c.metrics["e2e_s"] for c in done])
    for phase in ("queue", "prefill", "handoff", "decode"):
        key = "kv_handoff_s" if phase == "handoff" else f"{phase}_s"
        if any(key in c.metrics for c in done):
            summary[f"{phase}_ms_mean"] = 1000 * sum(c.metrics.get(key, 0.0) for c in done) / len(done)
    if any(work.urgent) and not all(work.urgent):
        for label, want in (("urgent", True), ("normal", False)):
            values = [1000 * c.metrics["ttft_s"] for c in done if work.urgent[int(c.req_id)] == want]
            summary |= {f"{label}_ttft_ms_p50": percentile(values, 50),
                        f"{label}_ttft_ms_p99": percentile(values, 99)}
    return summary


def bench_copy(num_bytes: int, repeat: int = 5) -> float:
    """GB/s of a plain in-process copy into a preallocated tensor of the same size: the handoff's yardstick."""
    src = torch.ones(max(1, num_bytes // 4))
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    return num_bytes * repeat / (time.perf_counter() - start) / 1e9


@dataclass(frozen=True)
class Run:
    """One configuration of the cross product."""

    mode: str  # local, colocated, disaggregated, or "url"
    slots: int | None
    token_budget: int | None
    rate: float
    priorities: bool

    def label(self) -> str:
        parts = [self.mode] + [f"{k}={v}" for k, v in (("slots", self.slots), ("budget", self.token_budget))
                               if v is not None]
        return " ".join(parts + [f"rate={self.rate:g}" if self.rate else "all-at-once"]
                        + ([] if self.priorities else ["no-priorities"]))


def plan_runs(args: argparse.Namespace, config: EngineConfig) -> list[Run]:
    slots = parse_list(args.sweep_slots, int, "--sweep-slots") or [config.slots]
    budgets = parse_list(args.sweep_token_budget, int, "--sweep-token-budget") or [config.token_budget]
    rates = parse_list(args.rate, float, "--rate") or [0.0]
    if any(r < 0 for r in rates) or any(s < 1 for s in slots) or any(b < 1 for b in budgets):
        raise ValueError("rates must be >= 0, slot counts and token budgets >= 1")
    if args.url:
        if args.modes or args.sweep_slots or args.sweep_token_budget:
            raise ValueError("--url benches the endpoint as it runs: --modes, --sweep-slots and "
                             "--sweep-token-budget apply only when the bench starts the engine itself")
        return [Run("url", None, None, rate, prio) for rate in rates
                for prio in ((False, True) if args.compare_priorities else (True,))]
    modes = (args.modes or config.mode).split(",")
    for mode in modes:
        if mode not in ("local", "colocated", "disaggregated"):
            raise ValueError(f"--modes: unknown mode {mode!r} (local, colocated, disaggregated)")
    return [Run(mode, s, b, rate, prio) for mode in modes for s in slots for b in budgets for rate in rates
            for prio in ((False, True) if args.compare_priorities else (True,))]


def _rounded(line: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}


def run_bench(config: EngineConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Print JSON lines, one summary per configuration as it finishes (per-request lines after them, or
    only in the `--output` file, which gets each run's lines as soon as it ends); draw the figure."""
    runs = plan_runs(args, config)
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    if set(baselines) - {"serial", "static"}:
        raise ValueError(f"--baselines: unknown {sorted(set(baselines) - {'serial', 'static'})} "
                         "(serial, static or none)")
    if baselines and args.url:
        raise ValueError("the serial and static baselines run the model in this process: with --url use "
                         "--baselines none")
    loaded, head, base = _prepare(config, args)
    if baselines:
        head |= _baselines(config, loaded, base, baselines, args.serial_requests, args.quiet)
        print(json.dumps(_rounded(head)), file=sys.stderr, flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = []
    with open(args.output, "w") if args.output else contextlib.nullcontext() as out:
        for run in runs:
            summary, per_request = _run_one(run, config, args, loaded, head, base)
            print(json.dumps(_rounded(summary)), flush=True)
            lines += [summary] + per_request
            if out is not None:  # each run's lines as it ends: a later failure loses nothing before it
                out.writelines(json.dumps(line) + "\n" for line in [summary] + per_request)
                out.flush()
    _compare_modes(lines)
    for line in lines:
        if "rid" in line:
            print(json.dumps(line), file=sys.stderr if args.output else sys.stdout)
    plot_path = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else None)
    if plot_path:
        from deploy.bench_plot import plot_bench

        plot_bench([line for line in lines if "rid" not in line], plot_path)
        print(f"figure: {plot_path}", file=sys.stderr)
    return lines


def _prepare(config: EngineConfig, args: argparse.Namespace) -> tuple[Any, dict[str, Any], Workload]:
    """Load the model (or, with --url, wait for the endpoint and warm it up), build the workload and the
    fields every summary line shares."""
    loaded = None
    if args.url:
        from deploy.bench_http import served_model, wait_ready
        from workers.loader import load_tokenizer

        wait_ready(args.url, args.ready_timeout)
        model_name = args.served_model_name or served_model(args.url, args.api_key)["id"]
        tokenizer = load_tokenizer(config.model).tokenizer  # the prompts' vocabulary: --model, as served
    else:
        from workers.loader import load_model

        loaded = load_model(config.model, config.dtype, config.device)
        tokenizer = loaded.tokenizer
    if args.prompts_file:
        base = load_workload(args.prompts_file, tokenizer, args.num_requests, args.output_len, args.seed,
                             args.urgent_fraction)
    else:
        vocab = loaded.model.spec.vocab_size if loaded is not None else len(tokenizer)
        base = make_workload(args.num_requests, args.prompt_len, args.output_len, vocab, args.seed,
                             urgent_fraction=args.urgent_fraction)
    head: dict[str, Any] = {"model": config.model, "requests": len(base.prompts),
                            "output_tokens": base.num_output_tokens, "seed": args.seed,
                            "torch_threads": torch.get_num_threads()}
    if loaded is not None:
        capacity = config.context_len(loaded.max_context)
        for i, (prompt, n) in enumerate(zip(base.prompts, base.output_lens, strict=True)):
            if len(prompt) + n > capacity:
                raise ValueError(f"request {i}: {len(prompt)} prompt + {n} output tokens exceed the "
                                 f"{capacity} tokens a slot holds: raise --max-model-len or shorten the lengths")
    else:
        from deploy.bench_http import EndpointError, run_http

        head |= {"url": args.url, "served_model": model_name}
        warm = run_http(args.url, model_name, [base.prompts[0][:16]], [2], [0.0], [0], args.api_key)["0"]
        if warm.error:  # untimed; a refusal here (wrong key, wrong model name) would fail every request
            raise EndpointError(f"{args.url}: the warm-up request failed: {warm.error}")
    return loaded, head, base


def _run_one(run: Run, config: EngineConfig, args: argparse.Namespace, loaded: Any, head: dict[str, Any],
             base: Workload) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One configuration, with a progress bar: its summary line and per-request lines."""
    work = replace(base, arrival_s=poisson_arrivals(len(base.prompts), run.rate, args.seed))
    chunk = min(config.prefill_chunk, run.token_budget) if run.token_budget else None
    extra: dict[str, Any] = {}
    with tqdm(total=len(work.prompts), desc=run.label(), unit="req", file=sys.stderr, leave=False,
              disable=args.quiet) as bar:
        on_finish = lambda _done: bar.update(1)
        if run.mode == "url":
            from deploy.bench_http import run_http

            start = time.perf_counter()
            results = run_http(args.url, head["served_model"], work.prompts, work.output_lens, work.arrival_s,
                               work.priorities(run.priorities), args.api_key, on_finish)
            elapsed = time.perf_counter() - start
        else:
            run_config = config.model_copy(update={"mode": run.mode, "slots": run.slots,
                                                   "token_budget": run.token_budget, "prefill_chunk": chunk})
            results, elapsed, extra = run_engine(run_config, loaded, work, args.sequential, run.priorities,
                                                 on_finish)
    summary = head | {"mode": run.mode, "slots": run.slots, "token_budget": run.token_budget,
                      "prefill_chunk": chunk, "rate": run.rate, "sequential": args.sequential,
                      "priorities": run.priorities}
    summary |= summarize_run(work, results, elapsed, args.slo_ttft_ms, args.slo_tpot_ms,
                             exact=run.mode != "url") | extra
    for key in ("serial_tok_s", "static_tok_s"):
        if key in head:
            summary[f"x_{key.split('_')[0]}"] = summary["output_tok_s"] / head[key]
    if "handoff_mb_per_request" in summary:
        copy = bench_copy(int(summary["handoff_mb_per_request"] * 1e6))
        summary |= {"copy_gb_s": copy, "handoff_vs_copy": summary["handoff_gb_s"] / copy}
    per_request = [{"rid": rid, "mode": run.mode, "slots": run.slots, "token_budget": run.token_budget,
                    "rate": run.rate, "tokens": len(c.token_ids), "finish": c.finish_reason}
                   | {f"{k}_ms": round(1000 * c.metrics[f"{k}_s"], 2) for k in ("ttft", "tpot", "e2e")
                      if f"{k}_s" in c.metrics}
                   | ({"error": c.error} if c.error else {})
                   for rid, c in sorted(results.items(), key=lambda kv: int(kv[0]))]
    return summary, per_request


def _baselines(config: EngineConfig, loaded: Any, work: Workload, baselines: list[str],
               serial_requests: int, quiet: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from workers.loader import resolve_checkpoint

    weight = loaded.model.output_weight()
    hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(config.model), dtype=weight.dtype)
    hf = hf.to(weight.device).eval()
    out: dict[str, Any] = {}
    with torch.inference_mode():
        if "serial" in baselines:
            with tqdm(total=min(serial_requests, len(work.prompts)), desc="serial generate", unit="req",
                      file=sys.stderr, leave=False, disable=quiet) as bar:
                out |= bench_serial(hf, work, serial_requests, bar.update)
        if "static" in baselines:
            with tqdm(total=len(work.prompts), desc=f"static generate, batches of {config.slots}", unit="req",
                      file=sys.stderr, leave=False, disable=quiet) as bar:
                out |= bench_static(hf, work, config.slots, bar.update)
    return out


def _compare_modes(lines: list[dict[str, Any]]) -> None:
    by_mode = {line["mode"]: line for line in lines if "rid" not in line}
    if "colocated" in by_mode and "disaggregated" in by_mode:
        ratio = by_mode["disaggregated"]["ttft_ms_mean"] / by_mode["colocated"]["ttft_ms_mean"]
        print(json.dumps({"ttft_disaggregated_over_colocated": round(ratio, 3)}), flush=True)

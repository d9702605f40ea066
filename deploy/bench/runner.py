"""`pdserve bench`: serving figures of the engine (or a running endpoint) and `transformers`
baselines in one run.

One run crosses every mode × slot count × token budget × arrival rate × priority setting asked
for, on the same prompts, and prints one JSON summary line per configuration (then per-request
lines); `--output` writes them all to a file and `--plot` draws the figure (deploy/bench/plot.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from deploy.bench.baselines import copy_bandwidth, run_baselines
from deploy.bench.repeats import median_lines, repeat_lines, rounds
from deploy.bench.stats import summarize, summarize_run
from deploy.bench.workload import (
    Workload,
    chat_workload,
    engine_requests,
    grounded_workload,
    interference_workload,
    load_workload,
    make_workload,
    next_turns,
    parse_list,
    shared_prefix_workload,
    shifting_workload,
    spread_models,
    warmup_request,
)
from deploy.config import MODES, EngineConfig
from deploy.driver import open_engine
from deploy.prompts import use_chat_template
from scheduler.cell.gc_pauses import startup_frozen
from scheduler.outputs import Completion


def run_engine(
    config: EngineConfig,
    loaded: Any,
    work: Workload,
    sequential: bool,
    priorities: bool,
    on_finish: Callable[[Completion], None],
) -> tuple[dict[str, Completion], float, dict[str, Any]]:
    """The workload through one engine mode, at its arrival times or one request at a time
    (`sequential`: the low-load case), after a warm-up request. Returns completions, wall seconds
    and mode-specific figures (the local profile, or the Ray step timeline)."""
    requests = engine_requests(work, priorities, config.loras)
    batches = [[r] for r in requests] if sequential else [requests]
    arrivals = None if sequential else {str(i): t for i, t in enumerate(work.arrival_s)}
    after = {str(i): str(before) for i, before in enumerate(work.after) if before is not None}
    results: dict[str, Completion] = {}
    with open_engine(config, loaded) as engine:
        engine.run([warmup_request(work)])
        engine.reset_profile()
        # no full collection walks the loaded model mid-run (scheduler/cell/gc_pauses.py)
        with startup_frozen():
            start = time.perf_counter()
            for batch in batches:
                results |= engine.run(batch, arrival_s=arrivals, on_finish=on_finish, after=after)
            elapsed = time.perf_counter() - start
        extra = engine.profile() | {"start_perf_s": start}
    handoff_bytes = sum(c.metrics.get("kv_handoff_bytes", 0) for c in results.values())
    handoff_s = sum(c.metrics.get("kv_handoff_s", 0.0) for c in results.values())
    if handoff_bytes:
        extra |= {
            "handoff_mb_per_request": handoff_bytes / len(results) / 1e6,
            "handoff_gb_s": handoff_bytes / handoff_s / 1e9,
        }
    return results, elapsed, extra


@dataclass(frozen=True)
class Run:
    """One configuration of the cross product."""

    mode: str  # local, colocated, disaggregated, or "url"
    slots: int | None
    token_budget: int | None
    rate: float
    priorities: bool
    prefix_cache: bool = True
    cache_routing: bool = True

    def label(self) -> str:
        parts = [self.mode] + [
            f"{k}={v}"
            for k, v in (("slots", self.slots), ("budget", self.token_budget))
            if v is not None
        ]
        return " ".join(
            parts
            + [f"rate={self.rate:g}" if self.rate else "all-at-once"]
            + ([] if self.priorities else ["no-priorities"])
            + ([] if self.prefix_cache else ["no-prefix-cache"])
            + ([] if self.cache_routing else ["routing-by-load"])
        )


def plan_runs(args: argparse.Namespace, config: EngineConfig) -> list[Run]:
    slots = parse_list(args.sweep_slots, int, "--sweep-slots") or [config.slots]
    budgets = parse_list(args.sweep_token_budget, int, "--sweep-token-budget") or [
        config.token_budget
    ]
    rates = parse_list(args.rate, float, "--rate") or [0.0]
    if any(r < 0 for r in rates) or any(s < 1 for s in slots) or any(b < 1 for b in budgets):
        raise ValueError("rates must be >= 0, slot counts and token budgets >= 1")
    if args.url:
        if args.modes or args.sweep_slots or args.sweep_token_budget:
            raise ValueError(
                "--url benches the endpoint as it runs: --modes, --sweep-slots and "
                "--sweep-token-budget apply only when the bench starts the engine itself"
            )
        return [
            Run("url", None, None, rate, prio)
            for rate in rates
            for prio in ((False, True) if args.compare_priorities else (True,))
        ]
    modes = (args.modes or config.mode).split(",")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"--modes: unknown mode {mode!r} ({', '.join(MODES)})")
    caches = (False, True) if args.compare_prefix_cache else (config.prefix_cache_tokens > 0,)
    routings = (True, False) if args.compare_cache_routing else (config.cache_routing,)
    return [
        Run(mode, s, b, rate, prio, cache, routing)
        for mode in modes
        for s in slots
        for b in budgets
        for rate in rates
        for prio in ((False, True) if args.compare_priorities else (True,))
        for cache in caches
        for routing in routings
    ]


def _rounded(line: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}


def run_bench(config: EngineConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Print JSON lines, one summary per configuration as it finishes (per-request lines after them,
    or only in the `--output` file, which gets each run's lines as soon as it ends); draw the
    figure."""
    runs = plan_runs(args, config)
    if args.repeat < 1:
        raise ValueError("--repeat must be at least 1")
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    if set(baselines) - {"serial", "static"}:
        raise ValueError(
            f"--baselines: unknown {sorted(set(baselines) - {'serial', 'static'})} "
            "(serial, static or none)"
        )
    if baselines and args.url:
        raise ValueError(
            "the serial and static baselines run the model in this process: with --url use "
            "--baselines none"
        )
    loaded, head, base = _prepare(config, args)
    if baselines:
        head |= run_baselines(config, loaded, base, baselines, args.serial_requests, args.quiet)
        print(json.dumps(_rounded(head)), file=sys.stderr, flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = []
    series: dict[str, Any] = {}
    with open(args.output, "w") if args.output else contextlib.nullcontext() as out:
        for r, run in rounds(runs, args.repeat):
            summary, per_request = _run_one(run, config, args, loaded, head, base, series)
            if args.repeat > 1:
                for line in [summary, *per_request]:
                    line["round"] = r
            print(json.dumps(_rounded(summary)), flush=True)
            lines += [summary] + per_request
            # each run's lines as it ends: a later failure loses nothing before it
            if out is not None:
                out.writelines(json.dumps(line) + "\n" for line in [summary] + per_request)
                out.flush()
    summaries = [line for line in lines if "rid" not in line]
    if args.repeat > 1:
        for line in repeat_lines(summaries):
            print(json.dumps(line), flush=True)
        # the comparisons and the figure: each configuration's median round
        summaries = median_lines(summaries)
    _compare_modes(summaries)
    for line in lines:
        if "rid" in line:
            print(json.dumps(line), file=sys.stderr if args.output else sys.stdout)
    plot_path = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else None)
    if plot_path:
        from deploy.bench.plot import plot_bench

        plot_bench(summaries, plot_path)
        print(f"figure: {plot_path}", file=sys.stderr)
        if series:
            from deploy.bench.plot import plot_interference

            interference_path = str(Path(plot_path).with_suffix("")) + "-interference.png"
            plot_interference(series, interference_path)
            print(f"figure: {interference_path}", file=sys.stderr)
    return lines


def _prepare(
    config: EngineConfig, args: argparse.Namespace
) -> tuple[Any, dict[str, Any], Workload]:
    """Load the model (or, with --url, wait for the endpoint and warm it up), build the workload and
    the fields every summary line shares."""
    loaded = None
    if args.url:
        from deploy.bench.http_client import served_model, wait_ready
        from workers.loader import load_tokenizer

        wait_ready(args.url, args.ready_timeout)
        model_name = args.served_model_name or served_model(args.url, args.api_key)["id"]
        # the prompts' vocabulary: --model, as served
        tokenizer = load_tokenizer(config.model).tokenizer
    else:
        from workers.loader import load_model

        loaded = load_model(config.model, config.dtype, config.device, config.quantization)
        tokenizer = loaded.tokenizer
    tokenizer = use_chat_template(tokenizer, config.chat_template)  # a prompts file's chats
    vocab = loaded.model.spec.vocab_size if loaded is not None else len(tokenizer)
    if args.prompts_file:
        base = load_workload(
            args.prompts_file,
            tokenizer,
            args.num_requests,
            args.output_len,
            args.seed,
            args.urgent_fraction,
        )
    elif args.workload == "shared-prefix":
        base = shared_prefix_workload(
            args.num_requests,
            args.groups,
            args.prefix_len,
            args.prompt_len,
            args.output_len,
            vocab,
            args.seed,
            args.urgent_fraction,
        )
    elif args.workload == "interference":
        base = interference_workload(
            args.steady,
            args.steady_prompt_len,
            args.steady_output_len,
            args.num_requests,
            args.prompt_len,
            args.output_len,
            vocab,
            args.seed,
            args.long_start_s,
            args.steady_generations,
        )
    elif args.workload == "shifting":
        base = shifting_workload(
            args.num_requests, args.prompt_len, args.output_len, vocab, args.seed
        )
    elif args.workload == "chat":
        base = chat_workload(
            args.groups, args.turns, args.prompt_len, args.output_len, vocab, args.seed
        )
    elif args.workload == "grounded":
        base = grounded_workload(
            args.num_requests, tokenizer, args.prompt_len, args.output_len, args.seed
        )
    else:
        base = make_workload(
            args.num_requests,
            args.prompt_len,
            args.output_len,
            vocab,
            args.seed,
            urgent_fraction=args.urgent_fraction,
        )
    if args.spread_loras:
        names = list(config.loras) if not args.url else _adapters(args.url, args.api_key)
        if not names:
            raise ValueError("--spread-loras: no LoRA adapter is served (--lora-modules)")
        base = spread_models(base, names)
    head: dict[str, Any] = {
        "model": config.model,
        "workload": args.workload,
        "requests": len(base.prompts),
        "output_tokens": base.num_output_tokens,
        "seed": args.seed,
        "torch_threads": torch.get_num_threads(),
    }
    if loaded is not None:
        capacity = config.context_len(loaded.max_context)
        for i, (prompt, n) in enumerate(zip(base.prompts, base.output_lens, strict=True)):
            if len(prompt) + n > capacity:
                raise ValueError(
                    f"request {i}: {len(prompt)} prompt + {n} output tokens exceed the "
                    f"{capacity} tokens a slot holds: raise --max-model-len or shorten the lengths"
                )
    else:
        from deploy.bench.http_client import EndpointError, run_http

        head |= {"url": args.url, "served_model": model_name}
        warm = run_http(
            args.url, model_name, [base.prompts[0][:16][::-1]], [2], [0.0], [0], args.api_key
        )[0]["0"]
        # untimed; a refusal here (wrong key, wrong model name) would fail every request
        if warm.error:
            raise EndpointError(f"{args.url}: the warm-up request failed: {warm.error}")
    return loaded, head, base


def _adapters(url: str, api_key: str | None) -> list[str]:
    """The LoRA adapters an endpoint lists (the models with a parent)."""
    import httpx

    from deploy.bench.http_client import auth_headers

    listed = httpx.get(f"{url.rstrip('/')}/models", headers=auth_headers(api_key), timeout=30)
    return [m["id"] for m in listed.json().get("data", []) if m.get("parent")]


def _run_one(
    run: Run,
    config: EngineConfig,
    args: argparse.Namespace,
    loaded: Any,
    head: dict[str, Any],
    base: Workload,
    series: dict[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One configuration, with a progress bar: its summary line and per-request lines (and, for the
    interference workload, the steady streams' ITL over time into `series`)."""
    work = base.at_rate(run.rate, args.seed).copy_prompts()
    chunk = min(config.prefill_chunk, run.token_budget) if run.token_budget else None
    extra: dict[str, Any] = {}
    workers = (
        args.colocated_workers
        if run.mode == "colocated" and args.colocated_workers
        else config.decode_workers
    )
    with tqdm(
        total=len(work.prompts),
        desc=run.label(),
        unit="req",
        file=sys.stderr,
        leave=False,
        disable=args.quiet,
    ) as bar:
        # (a chat's next turns are sent with the model's replies)
        on_finish = next_turns(work, then=lambda _done: bar.update(1))
        if run.mode == "url":
            from deploy.bench.http_client import run_http

            results, elapsed = run_http(
                args.url,
                head["served_model"],
                work.prompts,
                work.output_lens,
                work.arrival_s,
                work.priorities(run.priorities),
                args.api_key,
                on_finish,
                args.sequential,
                list(work.after),
                token_ids=work.conversation,  # a chat's next turn needs the reply's ids
                models=list(work.models) or None,
            )
        else:
            cache_tokens = config.prefix_cache_tokens if run.prefix_cache else 0
            run_config = config.model_copy(
                update={
                    "mode": run.mode,
                    "slots": run.slots,
                    "decode_workers": workers,
                    "token_budget": run.token_budget,
                    "prefill_chunk": chunk,
                    "prefix_cache_tokens": cache_tokens,
                    "cache_routing": run.cache_routing,
                }
            )
            results, elapsed, extra = run_engine(
                run_config, loaded, work, args.sequential, run.priorities, on_finish
            )
            if work.steady:  # the points of the interference figure
                start = extra.pop("start_perf_s")
                series[run.label()] = {
                    "itl": [
                        (end - start, 1000 * gap)
                        for rid, c in results.items()
                        if work.steady[int(rid)]
                        for end, gap in c.arrival_gaps_s()
                    ],
                    "arrivals": [
                        t for t, s in zip(work.arrival_s, work.steady, strict=True) if not s
                    ],
                }
                # the same gaps, only those that end while long prompts arrive or run (the streams'
                # ramp-up and any stream left running after the last long prompt left out)
                last = max(
                    (
                        c.token_times_s[-1] - start
                        for rid, c in results.items()
                        if not work.steady[int(rid)] and c.token_times_s
                    ),
                    default=math.inf,
                )
                during = [
                    ms for t, ms in series[run.label()]["itl"] if work.long_start_s <= t <= last
                ]
                # (none when the streams ended before the first long prompt: no figure, not 0)
                if during:
                    extra |= summarize("steady_itl_during_ms", during)
            extra.pop("start_perf_s", None)
    summary = head | {
        "mode": run.mode,
        "slots": run.slots,
        "token_budget": run.token_budget,
        "prefill_chunk": chunk,
        "rate": run.rate,
        "sequential": args.sequential,
        "priorities": run.priorities,
        "prefix_cache": run.prefix_cache,
        "decode_workers": workers,
        "prefill_workers": config.prefill_workers if run.mode == "disaggregated" else 0,
        "cache_routing": run.cache_routing,
    }
    if run.mode in ("colocated", "disaggregated"):  # each worker uses its actor's CPUs
        summary["torch_threads"] = config.worker_threads()
    if run.mode == "url":  # the server's deployment is its own: these describe nothing that ran
        summary |= dict.fromkeys(
            ("torch_threads", "prefix_cache", "decode_workers", "prefill_workers", "cache_routing")
        )
    summary |= (
        summarize_run(
            work, results, elapsed, args.slo_ttft_ms, args.slo_tpot_ms, exact=run.mode != "url"
        )
        | extra
    )
    if summary.get("prefill_tok_s_busy") and summary.get("decode_tok_s_busy"):
        # P:D sizing: busy seconds of prefill per request over busy seconds of decode per request
        prompt_tokens = sum(len(work.prompts[int(rid)]) for rid in results)
        output_tokens = sum(work.output_lens[int(rid)] for rid in results)
        summary["prefill_workers_per_decode_worker"] = (
            prompt_tokens / summary["prefill_tok_s_busy"]
        ) / (output_tokens / summary["decode_tok_s_busy"])
    for key in ("serial_tok_s", "static_tok_s"):
        if key in head:
            summary[f"x_{key.split('_')[0]}"] = summary["output_tok_s"] / head[key]
    if "handoff_mb_per_request" in summary:
        copy = copy_bandwidth(int(summary["handoff_mb_per_request"] * 1e6))
        # traffic against traffic: a handoff reads and writes each of its bytes at least once
        summary |= {"copy_gb_s": copy, "handoff_vs_copy": 2 * summary["handoff_gb_s"] / copy}
    per_request = [
        {
            "rid": rid,
            "mode": run.mode,
            "slots": run.slots,
            "token_budget": run.token_budget,
            "rate": run.rate,
            "tokens": len(c.token_ids),
            "finish": c.finish_reason,
        }
        | {
            f"{k}_ms": round(1000 * c.metrics[f"{k}_s"], 2)
            for k in ("ttft", "tpot", "e2e")
            if f"{k}_s" in c.metrics
        }
        | ({"error": c.error} if c.error else {})
        for rid, c in sorted(results.items(), key=lambda kv: int(kv[0]))
    ]
    return summary, per_request


def _compare_modes(summaries: list[dict[str, Any]]) -> None:
    by_mode = {line["mode"]: line for line in summaries}
    if "colocated" in by_mode and "disaggregated" in by_mode:
        ratio = by_mode["disaggregated"]["ttft_ms_mean"] / by_mode["colocated"]["ttft_ms_mean"]
        print(json.dumps({"ttft_disaggregated_over_colocated": round(ratio, 3)}), flush=True)
    for line in summaries:  # the prefix cache side by side: the same configuration with it off
        off = next(
            (
                o
                for o in summaries
                if not o["prefix_cache"]
                and o is not line
                and all(
                    o[k] == line[k]
                    for k in ("mode", "slots", "token_budget", "rate", "cache_routing")
                )
            ),
            None,
        )
        if line["prefix_cache"] and off is not None:
            print(
                json.dumps(
                    {
                        "mode": line["mode"],
                        "ttft_p50_no_cache_over_cache": round(
                            off["ttft_ms_p50"] / max(line["ttft_ms_p50"], 1e-9), 3
                        ),
                        "tok_s_cache_over_no_cache": round(
                            line["output_tok_s"] / off["output_tok_s"], 3
                        ),
                    }
                ),
                flush=True,
            )

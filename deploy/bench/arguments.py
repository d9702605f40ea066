"""The flags of `pdserve bench` and `pdserve gpu-bench` (argparse only: `pdserve --help` loads no
torch)."""

from __future__ import annotations

import argparse

GPU_PRESETS = ("qwen3-0.6b", "tiny")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=None,
        help="bench this running OpenAI endpoint (e.g. "
        "http://127.0.0.1:8000/v1) instead of starting an engine; --model names the tokenizer "
        "that random prompts are drawn from",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="with --url: the `model` to send (default: the first one the endpoint lists)",
    )
    parser.add_argument(
        "--api-key", default=None, help="with --url: sent as `Authorization: Bearer`"
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=120.0,
        help="with --url: seconds to wait for the endpoint's /health to answer 200",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=32,
        help="requests per configuration (with --prompts-file: the first N lines, 0 for all)",
    )
    parser.add_argument("--prompt-len", default="16:512", help="N or MIN:MAX (uniform), tokens")
    parser.add_argument("--output-len", default="16:256", help="N or MIN:MAX (uniform), tokens")
    parser.add_argument(
        "--workload",
        choices=("random", "shared-prefix", "chat", "interference", "shifting", "grounded"),
        default="random",
        help="random prompts; shared-prefix: --groups system prompts of --prefix-len tokens, "
        "each request one of them plus a suffix of --prompt-len; chat: --groups conversations "
        "of --turns turns, each turn sent when the one before ends, its prompt holding the "
        "conversation so far with the model's replies (user turns of --prompt-len, replies of "
        "--output-len; the first turns arrive at --rate); interference: --steady decoding streams "
        "while --num-requests long prompts (--prompt-len, --output-len) arrive at --rate; "
        "shifting: prompt-heavy, then output-heavy, then prompt-heavy thirds (the upper and "
        "lower halves of the length ranges), arriving at --rate; grounded: chats asking the "
        "model to repeat, quote or summarize with quotes a passage of --prompt-len tokens of "
        "English prose (answers that copy from their prompts: speculative decoding's n-gram "
        "workload)",
    )
    parser.add_argument(
        "--steady", type=int, default=16, help="interference: steady streams, all started at once"
    )
    parser.add_argument(
        "--steady-prompt-len", default="32:64", help="interference: the steady streams' prompts"
    )
    parser.add_argument(
        "--steady-output-len", default="512", help="interference: the steady streams' outputs"
    )
    parser.add_argument(
        "--steady-generations",
        type=int,
        default=1,
        help="interference: a steady population: each stream is followed, when it ends, by a "
        "new one, up to this many in all, while long prompts are still to come or running",
    )
    parser.add_argument(
        "--long-start-s",
        type=float,
        default=5.0,
        help="interference: seconds before the first long prompt (the streams are decoding)",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=8,
        help="system prompts (shared-prefix) or conversations (chat)",
    )
    parser.add_argument(
        "--prefix-len", type=int, default=1000, help="tokens of each shared system prompt"
    )
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (chat)")
    parser.add_argument(
        "--compare-prefix-cache",
        action="store_true",
        help="run each configuration with the prefix cache off and on, side by side",
    )
    parser.add_argument(
        "--spread-loras",
        action="store_true",
        help="requests spread evenly over the served model and every LoRA adapter "
        "(--lora-modules; with --url, those the endpoint lists)",
    )
    parser.add_argument(
        "--compare-cache-routing",
        action="store_true",
        help="run each configuration routing prompts by cache and by load only",
    )
    parser.add_argument(
        "--prompts-file",
        default=None,
        help="JSONL of prompts instead of random ones: "
        "`prompt`, `messages` or `prompt_token_ids` per line, optional `max_tokens`",
    )
    parser.add_argument(
        "--sweep-slots", default=None, help="comma list of slot counts to run the engine with"
    )
    parser.add_argument(
        "--sweep-token-budget",
        default=None,
        help="comma list of token budgets (e.g. 64,256,1024); prefill_chunk is capped at each",
    )
    parser.add_argument(
        "--baselines",
        default=None,
        help="comma list of serial,static or none (default: serial,static; none with --url)",
    )
    parser.add_argument(
        "--serial-requests",
        type=int,
        default=8,
        help="serial generate runs only this many requests (its rate is per token)",
    )
    parser.add_argument(
        "--modes",
        default=None,
        help="comma list of modes to run side by side in one run "
        "(e.g. colocated,disaggregated); default: --mode",
    )
    parser.add_argument(
        "--colocated-workers",
        type=int,
        default=None,
        help="colocated runs use this many workers (e.g. prefill + decode workers of the "
        "disaggregated runs, for equal CPUs); default: --decode-workers",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="send one request at a time (low load: time to first token without queueing)",
    )
    parser.add_argument(
        "--rate",
        default="0",
        help="Poisson arrivals, requests/s (0: all at once); a comma list "
        "sweeps the rates (e.g. 0.5,1,2)",
    )
    parser.add_argument(
        "--urgent-fraction",
        type=float,
        default=0.0,
        help="this fraction of requests is urgent (priority 0; the rest priority 1)",
    )
    parser.add_argument(
        "--compare-priorities",
        action="store_true",
        help="run each configuration with priorities off and on (urgent TTFT side by side)",
    )
    parser.add_argument(
        "--slo-ttft-ms", type=float, default=None, help="goodput counts requests under this TTFT"
    )
    parser.add_argument(
        "--slo-tpot-ms", type=float, default=None, help="goodput counts requests under this TPOT"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="prompts, lengths and arrivals depend only on it"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every configuration this many times, the order reversed every other round, "
        "then print each one's median, range and (beside local) per-round ratio",
    )
    parser.add_argument(
        "--output",
        default=None,
        help="also write the JSON lines to this file (and the figure next to it, as .png)",
    )
    parser.add_argument(
        "--plot", default=None, help="write the figure here (PNG; default: --output with .png)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_gpu_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=GPU_PRESETS,
        default="qwen3-0.6b",
        help="model shape, random weights: qwen3-0.6b (Qwen3-0.6B) or tiny (for tests)",
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32"
    )
    parser.add_argument(
        "--slots", default="1,2,4,8,16,32,64", help="comma-separated slot counts to sweep"
    )
    parser.add_argument(
        "--requests-per-slot", type=int, default=2, help="requests per slot count: this x slots"
    )
    parser.add_argument(
        "--min-requests", type=int, default=4, help="at least this many requests per slot count"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=128, help="prompt tokens of every request"
    )
    parser.add_argument(
        "--output-len", type=int, default=128, help="output tokens of every request"
    )
    parser.add_argument(
        "--prefill-chunk", type=int, default=128, help="most prompt tokens of one request per step"
    )
    parser.add_argument(
        "--token-budget",
        type=int,
        default=0,
        help="tokens per engine step; 0: max(256, slots x min(prompt, chunk)), all prefill at once",
    )
    parser.add_argument(
        "--detokenize",
        action="store_true",
        help="give the engine the (word-level) tokenizer, so decode steps include detokenizing",
    )
    parser.add_argument(
        "--copy-mib",
        type=float,
        default=0,
        help="tensor size of the copy-bandwidth measurement; 0: 1024 on cuda, 128 on cpu",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=240.0,
        help="seconds for the whole run, roofline included; slot counts projected to end past "
        "this are skipped (and reported)",
    )
    parser.add_argument(
        "--roofline-seconds",
        type=float,
        default=150.0,
        help="time for the roofline points (decode vs bytes at copy speed, prefill vs the matmul "
        "peak); points past it are skipped (and reported); 0 leaves the roofline out",
    )
    parser.add_argument(
        "--roofline-shapes",
        default="auto",
        help="model shapes of the roofline, random weights built on the device: qwen3-0.6b, "
        "llama3-8b, tiny; auto: llama3-8b,qwen3-0.6b on cuda, tiny on cpu",
    )
    parser.add_argument(
        "--roofline-decode",
        default="auto",
        help="decode points, rows x context, e.g. 1x1024,64x1024; auto: batch 1-256 x "
        "context 128-4096 on cuda (as the KV pool fits), 1x32,4x64 on cpu",
    )
    parser.add_argument(
        "--roofline-prefill",
        default="auto",
        help="prefill points, prompt tokens; auto: 512-8192 on cuda, 32,64 on cpu",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="where the random checkpoint is saved (and reused); default: a temporary folder",
    )
    parser.add_argument(
        "--output", default="results/gpu_bench.jsonl", help="JSON lines file ('' for none)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    parser.add_argument(
        "--fit-cost-model",
        metavar="PATH",
        help="instead of the sweep, time the model's forward on a grid of prompts and decode "
        "batches and write the fitted cost model of `python -m benchmarks.gpu_sim` (JSON)",
    )
    parser.add_argument(
        "--link-gb-s",
        type=float,
        default=450.0,
        help="with --fit-cost-model: the prefill-to-decode link's GB/s (default: NVLink 4, one "
        "direction, H100/H200 SXM datasheet)",
    )
    parser.add_argument(
        "--startup-s",
        type=float,
        default=30.0,
        help="with --fit-cost-model: a worker's start-up, seconds (weights read, warm-up)",
    )


def add_gpu_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    parser.add_argument(
        "--sweep-seconds",
        type=float,
        default=150.0,
        help="time for the slots sweep against HF static batching; 0 skips it",
    )
    parser.add_argument("--no-sweep", dest="sweep_seconds", action="store_const", const=0.0)
    parser.add_argument(
        "--skip", action="append", help="a check to leave out (repeatable), e.g. logprobs_bf16"
    )
    parser.add_argument("--workdir", help="where the test checkpoint is written (a temp dir)")
    parser.add_argument("--output", help="also write the JSON report here")

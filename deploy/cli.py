"""The `pdserve` console script: `generate` (batch job), `bench` (benchmark) and `serve` (HTTP)."""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

from deploy.config import EngineConfig

_ENGINE_FLAGS: dict[str, tuple[str, type]] = {  # flag -> (EngineConfig field, type)
    "--model": ("model", str), "--mode": ("mode", str), "--slots": ("slots", int),
    "--max-model-len": ("max_model_len", int), "--token-budget": ("token_budget", int),
    "--prefill-chunk": ("prefill_chunk", int), "--max-waiting": ("max_waiting", int),
    "--dtype": ("dtype", str), "--device": ("device", str), "--prefill-workers": ("prefill_workers", int),
    "--decode-workers": ("decode_workers", int), "--local-prefill-max-tokens": ("local_prefill_max_tokens", int),
    "--num-cpus-per-worker": ("num_cpus_per_worker", float),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, described by the config itself; unset flags keep its defaults."""
    for flag, (name, kind) in _ENGINE_FLAGS.items():
        field = EngineConfig.model_fields[name]
        extra = {"choices": ["local", "colocated", "disaggregated"]} if name == "mode" else {}
        parser.add_argument(flag, dest=name, type=kind, default=None,
                            help=f"{field.description} (default: {field.default})", **extra)


def config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    names = [name for name, _ in _ENGINE_FLAGS.values()]
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    return EngineConfig(**(given | {k: v for k, v in overrides.items() if v is not None}))


def _cmd_generate(args: argparse.Namespace) -> int:
    from deploy.batch import BatchInputError, run_generate

    try:
        config = config_from_args(args)
        lines = run_generate(config, args.input, args.output, progress=not args.quiet)
    except (BatchInputError, ValidationError, ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    tokens = sum(len(line["token_ids"]) for line in lines)
    print(f"wrote {len(lines)} results ({tokens} tokens) to {args.output}", file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from deploy.bench import run_bench

    try:
        config = config_from_args(args)
        run_bench(config, args)
    except (ValidationError, ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    print("pdserve serve: the HTTP service is not available yet (see the serving issue); "
          "use `pdserve generate` for batch jobs.", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="run a JSONL batch of requests to a JSONL file of results")
    gen.add_argument("--input", required=True, help="JSONL, one request per line")
    gen.add_argument("--output", required=True, help="JSONL results, written whole at the end")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="throughput of the engine against serial and static generate")
    add_engine_args(bench)
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--prompt-len", default="16:512", help="N or MIN:MAX (uniform), tokens")
    bench.add_argument("--output-len", default="16:256", help="N or MIN:MAX (uniform), tokens")
    bench.add_argument("--sweep-slots", default=None, help="comma list of slot counts to run the engine with")
    bench.add_argument("--baselines", default="serial,static", help="comma list of serial,static or none")
    bench.add_argument("--serial-requests", type=int, default=8,
                       help="serial generate runs only this many requests (its rate is per token)")
    bench.add_argument("--modes", default=None, help="comma list of modes to run side by side in one run "
                       "(e.g. colocated,disaggregated); default: --mode")
    bench.add_argument("--sequential", action="store_true",
                       help="send one request at a time (low load: time to first token without queueing)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--output", default=None, help="also write the JSON lines to this file")
    bench.set_defaults(func=_cmd_bench)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

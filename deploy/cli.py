"""The `pdserve` console script: `generate` (batch job), `bench` / `gpu-bench`, `serve` (HTTP),
`load`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
import types
import typing
from typing import Any

from pydantic import ValidationError

from deploy.bench.arguments import (
    add_bench_arguments,
    add_gpu_bench_arguments,
    add_gpu_check_arguments,
)
from deploy.config import EngineConfig, ReplyConfig, ServiceConfig


def _engine_fields(
    cls: type[EngineConfig] = EngineConfig,
) -> dict[str, tuple[str, type, tuple[str, ...] | None]]:
    """Every field of a plain type of the config class as a flag: --flag-name -> (field, type,
    choices)."""
    flags = {}
    for name, field in cls.model_fields.items():
        kind = field.annotation
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `int | None` -> int
            kind = next((k for k in typing.get_args(kind) if k is not type(None)), kind)
        if typing.get_origin(kind) is typing.Literal:
            flags[f"--{name.replace('_', '-')}"] = (name, str, typing.get_args(kind))
        elif kind in (int, float, str):
            flags[f"--{name.replace('_', '-')}"] = (name, kind, None)
        elif kind is bool:
            flags[f"--{name.replace('_', '-')}"] = (name, _truth, None)
        elif typing.get_origin(kind) is list:  # one or more values: --lora-modules a=x b=y
            flags[f"--{name.replace('_', '-')}"] = (name, list, None)
    return flags


def _truth(text: str) -> bool:
    """A boolean flag's value: true/false (also yes/no, on/off, 1/0)."""
    value = {
        "true": True,
        "yes": True,
        "on": True,
        "1": True,
        "false": False,
        "no": False,
        "off": False,
        "0": False,
    }
    if text.lower() not in value:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value[text.lower()]


def add_engine_args(
    parser: argparse.ArgumentParser, cls: type[EngineConfig] = EngineConfig
) -> None:
    """One flag per config field, described by the config itself; unset flags keep its defaults."""
    for flag, (name, kind, choices) in _engine_fields(cls).items():
        field = cls.model_fields[name]
        default = str(field.default).lower() if kind is _truth else field.default
        # a boolean flag alone means true (vLLM's `--enforce-eager`), or takes true/false
        nargs = "+" if kind is list else "?" if kind is _truth else None
        parser.add_argument(
            flag,
            dest=name,
            type=str if kind is list else kind,
            nargs=nargs,
            const=True if kind is _truth else None,
            default=None,
            choices=choices,
            metavar="{true,false}" if kind is _truth else None,
            help=f"{field.description} (default: {default})",
        )
    if "slots" in cls.model_fields:  # vLLM's name of the same knob
        parser.add_argument("--max-num-seqs", dest="slots", type=int, help="the same as --slots")


def config_from_args(
    args: argparse.Namespace, cls: type[EngineConfig] = EngineConfig, **overrides: object
) -> Any:
    """The config of the flags given; unset flags (None) keep the config class's defaults."""
    names = [name for name, _, _ in _engine_fields(cls).values()]
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    return cls(**(given | {k: v for k, v in overrides.items() if v is not None}))


def _cmd_generate(args: argparse.Namespace) -> int:
    from deploy.batch import BatchInputError, run_generate
    from deploy.openai_batch import is_openai_batch, run_openai_batch

    try:
        config = config_from_args(args, ReplyConfig)
        if is_openai_batch(args.input):
            lines = run_openai_batch(config, args.input, args.output, progress=not args.quiet)
            failed = sum(line["response"]["status_code"] != 200 for line in lines)
            print(
                f"wrote {len(lines)} OpenAI batch results ({failed} failed) to {args.output}",
                file=sys.stderr,
            )
            return 0
        lines = run_generate(config.engine(), args.input, args.output, progress=not args.quiet)
    except (BatchInputError, ValidationError, ValueError, FileNotFoundError) as e:
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    tokens = sum(len(line["token_ids"]) for line in lines)
    print(f"wrote {len(lines)} results ({tokens} tokens) to {args.output}", file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from deploy.bench.http_client import EndpointError
    from deploy.bench.runner import run_bench
    from deploy.bench.stats import BenchFailed

    if args.baselines is None:
        args.baselines = "none" if args.url else "serial,static"
    try:
        config = config_from_args(args)
        run_bench(config, args)
    except (ValidationError, ValueError, FileNotFoundError, EndpointError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    except BenchFailed as e:
        print(f"pdserve bench: failed: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_bench_plot(args: argparse.Namespace) -> int:
    import json

    from deploy.bench.plot import plot_bench

    summaries = []
    try:
        for path in args.results:
            with open(path) as f:
                summaries += [
                    line for line in map(json.loads, filter(str.strip, f)) if "output_tok_s" in line
                ]
    except (OSError, ValueError) as e:
        print(f"pdserve bench-plot: error: {e}", file=sys.stderr)
        return 2
    if not summaries:
        print(
            "pdserve bench-plot: error: no bench summary lines in the files given", file=sys.stderr
        )
        return 2
    plot_bench(summaries, args.plot)
    print(f"figure: {args.plot} ({len(summaries)} runs)", file=sys.stderr)
    return 0


def _cmd_gpu_bench(args: argparse.Namespace) -> int:
    from deploy.bench.gpu import run_gpu_bench

    run_gpu_bench(args)
    return 0


def _cmd_gpu_check(args: argparse.Namespace) -> int:
    from deploy.bench.gpu_check import main

    return main(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args, ServiceConfig)
        direct = _direct_ingress(args, config)
        _check_port(args.host, args.port)
    except (ValidationError, ValueError, OSError) as e:
        print(f"pdserve serve: error: {e}", file=sys.stderr)
        return 2
    if direct:  # read by Serve's controller and replicas: set before Ray (and Serve) start
        os.environ.update(_direct_ingress_env(args.port))
    # With direct ingress Serve still starts its HTTP proxy on the head node: it gets a free port,
    # not --port
    proxy_port = _free_port(args.host) if direct else args.port
    from ray import serve

    from deploy.ray_cell import init_ray
    from deploy.serving.app import APP_NAME, build_app
    from deploy.serving.drain import clear_drain, request_drain, wait_drained

    init_ray(config)
    clear_drain(APP_NAME)  # (a Ray joined through RAY_ADDRESS may remember an earlier one)
    serve.start(http_options={"host": args.host, "port": proxy_port})
    serve.run(build_app(config.model_dump()), name=APP_NAME, route_prefix="/", blocking=False)
    base = f"http://{args.host}:{args.port}/v1"
    auth = f" -H 'Authorization: Bearer {config.api_key}'" if config.api_key else ""
    print(
        f"\npdserve is serving {config.model_name} ({config.mode}, "
        f"{'direct ingress' if direct else 'Serve proxy'}) at {base}\ntry:\n"
        f"  curl {base}/chat/completions -H 'Content-Type: application/json'{auth} -d "
        f'\'{{"model": '
        f'"{config.model_name}", "messages": [{{"role": "user", "content": "What is the capital of '
        f'France?"}}], "max_tokens": 40}}\'\nCtrl-C stops it.',
        flush=True,
    )
    # `kill`, systemd, docker stop: as Ctrl-C
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        # not ready at once, new requests refused, open streams given --drain-timeout-s (a second
        # signal stops at once)
        print("pdserve: draining, then stopping", file=sys.stderr, flush=True)
        try:
            request_drain(APP_NAME)
            wait_drained(APP_NAME, config.drain_timeout_s + 10)
            time.sleep(1.0)  # the ended streams' last events reach their clients
        except KeyboardInterrupt:
            pass
        serve.shutdown()
    return 0


def _direct_ingress(args: argparse.Namespace, config: ServiceConfig) -> bool:
    """Whether the ingress replica serves HTTP itself (`--ingress direct`), skipping Serve's proxy.

    Direct needs the Ray this command starts (Serve reads the setting when its controller starts)
    and one ingress replica (it listens on --port itself); by default it is used wherever it can
    be."""
    joined = bool(os.environ.get("RAY_ADDRESS"))
    if args.ingress == "direct" and joined:
        raise ValueError(
            "--ingress direct needs the Ray this command starts; with RAY_ADDRESS set, Serve "
            "follows "
            "the cluster's own environment (README, Serving); use --ingress proxy"
        )
    if args.ingress == "direct" and config.ingress_replicas > 1:
        raise ValueError(
            "--ingress direct serves from one ingress replica on --port; with "
            f"--ingress-replicas {config.ingress_replicas} use --ingress proxy"
        )
    return args.ingress == "direct" or (
        args.ingress is None and not joined and config.ingress_replicas == 1
    )


def _check_port(host: str, port: int) -> None:
    """Fail before Ray starts, and say why, when the port cannot be listened on (another server has
    it)."""
    with socket.socket() as s:
        # as the server will: TIME_WAIT is no conflict
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(
                f"cannot listen on {host}:{port} ({e.strerror}); is another server running there? "
                "Pick another port with --port"
            ) from None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's direct ingress (Ray 2.60, experimental): no HTTP proxy; the ingress replica
    listens on `port` itself, gives it up at once when stopped, and can take it again when
    restarted. With it, two more of Serve's throughput settings: a replica runs its handlers and its
    handles' router on its own event loop, with no hop between threads per message (about a fifth
    more streamed tokens/s on the tiny model, docs/BENCHMARKS.md)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def _cmd_load(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from deploy.bench.http_client import EndpointError, wait_ready
    from deploy.bench.load import run_load

    try:
        wait_ready(args.url, args.ready_timeout)
    except EndpointError as e:
        print(f"pdserve load: error: {e}", file=sys.stderr)
        return 2
    result = asyncio.run(
        run_load(
            args.url,
            args.model_name,
            args.clients,
            args.duration,
            args.max_tokens,
            api_key=args.api_key,
        )
    )
    print(json.dumps(result))
    return 0 if result["failed"] == 0 and result["slots_in_use_after"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate", help="run a JSONL batch of requests to a JSONL file of results"
    )
    gen.add_argument(
        "--input",
        required=True,
        help="JSONL, one request per line: pdserve's lines, or OpenAI batch "
        "lines ({custom_id, method, url, body})",
    )
    gen.add_argument("--output", required=True, help="JSONL results, written whole at the end")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(gen, ReplyConfig)
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser(
        "bench",
        help="serving benchmark: engine modes and sweeps, or a running endpoint "
        "(--url), against serial and static transformers generate",
    )
    add_engine_args(bench)
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    replot = sub.add_parser(
        "bench-plot", help="draw the bench figure from the JSON lines of one or more runs"
    )
    replot.add_argument(
        "results",
        nargs="+",
        help="`pdserve bench --output` files (their serial/static "
        "baselines are taken from the first)",
    )
    replot.add_argument("--plot", required=True, help="PNG to write")
    replot.set_defaults(func=_cmd_bench_plot)

    gpu = sub.add_parser(
        "gpu-bench",
        help="offline GPU benchmark: a random-weight Qwen3-0.6B, slots sweep "
        "against transformers static batching, decode-step memory bandwidth",
    )
    add_gpu_bench_arguments(gpu)
    gpu.set_defaults(func=_cmd_gpu_bench)

    check = sub.add_parser(
        "gpu-check",
        help="check a GPU machine whole in minutes: parity with transformers, sampling, KV "
        "transports, disaggregated workers, the slots sweep; JSON out, non-zero on a failure",
    )
    add_gpu_check_arguments(check)
    check.set_defaults(func=_cmd_gpu_check)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API through Ray Serve")
    add_engine_args(serve, ServiceConfig)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--ingress",
        choices=("direct", "proxy"),
        default=None,
        help="direct: the ingress replica serves HTTP on --port itself (Ray Serve's direct "
        "ingress; about twice the streamed tokens/s of a small model on 2 cores); proxy: Serve's "
        "HTTP "
        "proxy in front of the ingress replicas (default: direct, except with RAY_ADDRESS set "
        "or --ingress-replicas above 1)",
    )
    serve.set_defaults(func=_cmd_serve)
    load = sub.add_parser("load", help="sustained streaming load against a running endpoint")
    load.add_argument("--url", default="http://127.0.0.1:8000/v1")
    load.add_argument("--model-name", default="smollm2-135m-instruct", help="the `model` to send")
    load.add_argument("--clients", type=int, default=64)
    load.add_argument("--duration", type=float, default=60.0, help="seconds")
    load.add_argument("--max-tokens", type=int, default=32)
    load.add_argument("--api-key", default=None)
    load.add_argument(
        "--ready-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the endpoint's /health to answer 200 before starting",
    )
    load.set_defaults(func=_cmd_load)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

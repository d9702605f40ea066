"""An ingress drains on SIGTERM to `pdserve serve` and when Serve stops it: not ready at once, new
requests refused with 503 and Retry-After, open streams finish within --drain-timeout-s, the rest
end with an error event."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.serving.servers import wait_ready
from tests.factories import free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]
DRAIN_TIMEOUT_S = 1.5


def stream(base: str, max_tokens: int, started: threading.Event, record: dict) -> None:
    """One streamed completion; records its events and when its last one came."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", f"{base}/v1/completions", json=body | {"stream": True}, timeout=120
    ) as r:
        record["status"] = r.status_code
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    record["events"] = events
    record["ended_s"] = time.monotonic()


def tokens_and_error(record: dict) -> tuple[int, dict | None]:
    chunks = [json.loads(e) for e in record["events"][:-1]]
    error = next((c["error"] for c in chunks if "error" in c), None)
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    return (usage["completion_tokens"] if usage else 0), error


@pytest.mark.slow
def test_sigterm_lets_streams_finish_up_to_the_drain_timeout_then_ends_the_rest(
    tiny_checkpoint, tmp_path
):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    argv = ["--model", tiny_checkpoint, "--served-model-name", "tiny", "--mode", "colocated"]
    argv += ["--slots", "16", "--max-model-len", "1024", "--max-burst-ms", "0"]
    argv += ["--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
    try:
        wait_ready(proc, base, log)
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
        # 16 streams: 8 short ones, which finish during the drain, and 8 that cannot finish in it
        records = [{} for _ in range(16)]
        started = [threading.Event() for _ in range(16)]
        threads = [
            threading.Thread(
                target=stream, args=(base, 24 if i % 2 else 1000, started[i], records[i])
            )
            for i in range(16)
        ]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(60)
        sigterm_s = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # not ready at once: within the drain, not after it
        wait_for(
            lambda status: status != 200,
            2,
            value=lambda: httpx.get(f"{base}/ready", timeout=5).status_code,
            what="/ready to answer other than 200 after SIGTERM",
        )
        refused = httpx.post(
            f"{base}/v1/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 2}
        )
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "shutting_down"
        for thread in threads:
            thread.join(timeout=DRAIN_TIMEOUT_S + 30)
            assert not thread.is_alive(), "a stream hung"
        ended_by_drain = 0
        for i, record in enumerate(records):
            assert record["status"] == 200 and record["events"][-1] == "[DONE]", record
            tokens, error = tokens_and_error(record)
            if error is None:  # finished: whole
                assert tokens == (24 if i % 2 else 1000), (i, tokens)
                continue
            # ended by the drain: not before its timeout, and soon after it
            ended_by_drain += 1
            assert error["code"] == "shutting_down", error
            assert DRAIN_TIMEOUT_S - 0.2 <= record["ended_s"] - sigterm_s <= DRAIN_TIMEOUT_S + 10
        assert ended_by_drain >= 1  # (else this run tested nothing about the timeout)
        assert all(tokens_and_error(r)[1] is None for r in records[1::2])  # short ones whole
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_an_ingress_replica_serve_scales_down_drains_its_streams(ray_session, tiny_checkpoint):
    """Two ingress replicas, one slot, 16 streams queued behind each other (each about 0.5 s):
    when Serve scales the ingress down to one replica, the one it stops ends its streams still
    open after the drain timeout with an error event; nothing is cut, nothing hangs."""
    from ray import serve

    from deploy.config import ServiceConfig
    from deploy.serving.app import OpenAIIngress
    from deploy.serving.cells import Cell

    args = {"model": tiny_checkpoint, "served_model_name": "tiny", "mode": "colocated"}
    args |= {"slots": 1, "max_model_len": 1024, "drain_timeout_s": DRAIN_TIMEOUT_S}
    config = ServiceConfig(**args)

    def app(num_ingress: int) -> serve.Application:
        cells = Cell.options(num_replicas=1).bind(config.engine().model_dump())
        ingress = OpenAIIngress.options(
            num_replicas=num_ingress, graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S + 30
        )
        return ingress.bind(cells, config.model_dump())

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    try:
        serve.run(app(2), name="scaled", route_prefix="/")
        records = [{} for _ in range(16)]
        started = [threading.Event() for _ in range(16)]
        threads = [
            threading.Thread(target=stream, args=(base, 1000, started[i], records[i]))
            for i in range(16)
        ]
        for thread in threads:
            thread.start()
        # every stream placed (most wait for the one slot)
        wait_for(
            lambda stats: stats["streams"] == 16,
            60,
            value=lambda: httpx.get(f"{base}/stats", timeout=10).json(),
        )
        scaled_s = time.monotonic()
        serve.run(app(1), name="scaled", route_prefix="/")  # Serve stops one replica
        for thread in threads:
            thread.join(timeout=120)
            assert not thread.is_alive(), "a stream hung"
        drained = []
        for record in records:
            assert record["status"] == 200 and record["events"][-1] == "[DONE]", record
            tokens, error = tokens_and_error(record)
            if error is None:
                assert tokens == 1000
            else:
                assert error["code"] == "shutting_down", error
                drained.append(record["ended_s"] - scaled_s)
        # the stopped replica's streams still waiting at its drain timeout ended then, not before
        assert drained and min(drained) >= DRAIN_TIMEOUT_S - 0.2, drained
    finally:
        serve.shutdown()

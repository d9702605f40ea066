"""`pdserve serve` as a user runs it: its own Ray, the ingress replica serving HTTP on --port
itself."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deploy.cli import main
from tests.deploy.serving.servers import local_text, wait_ready
from tests.factories import free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pdserve_serve_streams_on_its_port_frees_a_dropped_stream_and_stops_on_sigterm(
    tiny_checkpoint, tmp_path
):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    # a Ray of its own, as `make serve`
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deploy.cli",
                "serve",
                "--model",
                tiny_checkpoint,
                "--served-model-name",
                "tiny",
                "--mode",
                "colocated",
                "--slots",
                "4",
                "--max-model-len",
                "1024",
                "--port",
                str(port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
    try:
        wait_ready(proc, base, log)
        assert f"(colocated, direct ingress) at {base}/v1" in log.read_text()

        prompt = [5, 6, 7, 8]
        want = local_text(tiny_checkpoint, prompt_token_ids=prompt, max_tokens=16)[0]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        assert (
            httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            == want
        )
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body | {"stream": True}, timeout=60
        ) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert (
            "".join(
                json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]
            )
            == want
        )

        def stats() -> dict:
            return httpx.get(f"{base}/stats", timeout=10).json()

        # dropped after one event
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            timeout=60,
            json={
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 1000,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            next(r.iter_lines())
        aborted = wait_for(lambda s: s["counters"]["aborts"], 30, value=stats)
        assert aborted["counters"]["aborts"] == 1
        assert sum(w["slots_used"] for w in stats()["workers"].values()) == 0

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        with socket.socket() as s:  # the port is free again
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "argv, env, says",
    [
        (["--ingress", "direct", "--ingress-replicas", "2"], {}, "use --ingress proxy"),
        (
            ["--ingress", "direct"],
            {"RAY_ADDRESS": "127.0.0.1:1"},
            "needs the Ray this command starts",
        ),
    ],
)
def test_direct_ingress_it_cannot_give_is_refused_before_anything_starts(
    argv, env, says, monkeypatch, capsys
):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", "--model", "unused", *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_port_in_use_is_refused_with_a_clear_error_before_ray_starts(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "unused", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err

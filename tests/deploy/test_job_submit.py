"""A real `ray start --head` on loopback and `ray job submit` of a generate job.

The head is this test's own: its own token (in the environment of the head and the client only), its
own temp dir and ports, started with `--block` in a new session so that stopping it stops only it,
never another Ray on the machine (such as the session's shared one). Nothing reads or writes
`~/.ray`.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import free_port
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture
def ray_head() -> Iterator[tuple[str, dict[str, str]]]:
    """Start a Ray head of our own; yield (dashboard address, client environment); stop only it."""
    token = secrets.token_hex(32)
    env = os.environ | {
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "RAY_ADDRESS": "",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
    }
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    # short: Ray puts Unix sockets in it
    temp_dir = tempfile.mkdtemp(prefix="pdserve-ray-", dir="/tmp")
    dashboard = free_port()
    ports = {
        "--port": free_port(),
        "--dashboard-port": dashboard,
        "--ray-client-server-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--metrics-export-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
    }
    log = open(Path(temp_dir) / "head.log", "w")  # noqa: SIM115 (closed below)
    head = subprocess.Popen(
        [
            BIN / "ray",
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            *(f"{flag}={port}" for flag, port in ports.items()),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        time.sleep(1)  # a grace second before anything of its session that outlived it is killed
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_runs_a_generate_job(ray_head, tiny_checkpoint, tmp_path):
    address, env = ray_head
    rows = [
        {"id": f"q{i}", "prompt_token_ids": [5 + i, 9, 14, 100], "max_tokens": 6, "temperature": 0}
        for i in range(4)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    submit = [
        BIN / "ray",
        "job",
        "submit",
        f"--address={address}",
        "--working-dir",
        ROOT,
        "--",
        "pdserve",
        "generate",
        "--mode",
        "disaggregated",
        "--model",
        tiny_checkpoint,
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(out),
        "--max-model-len",
        "64",
    ]
    job = wait_for(
        lambda job: (
            not any(
                s in job.stdout + job.stderr
                for s in ("No available agent", "Connection refused", "Failed to connect")
            )
        ),
        120,
        value=lambda: subprocess.run(submit, env=env, capture_output=True, text=True, timeout=400),
        what="the head to answer with its job agent up",
        poll_s=2,
    )
    logs = job.stdout + job.stderr
    assert job.returncode == 0, logs[-4000:]
    assert "succeeded" in logs and "wrote 4 results" in logs
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["q0", "q1", "q2", "q3"]
    assert all(
        len(line["token_ids"]) == 6 and line["metrics"]["kv_handoff_bytes"] > 0 for line in lines
    )


def test_job_client_without_the_token_is_refused(ray_head):
    """The head really requires the token: a client that lacks it is turned away."""
    address, env = ray_head
    without = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"} | {"HOME": tempfile.mkdtemp()}
    job = wait_for(
        lambda job: (
            not any(
                s in job.stdout + job.stderr for s in ("Connection refused", "Failed to connect")
            )
        ),
        120,
        value=lambda: subprocess.run(
            [BIN / "ray", "job", "list", f"--address={address}"],
            env=without,
            capture_output=True,
            text=True,
            timeout=120,
        ),
        what="the head to answer",
        poll_s=2,
    )
    logs = job.stdout + job.stderr
    assert job.returncode != 0 and "token" in logs.lower(), logs[-2000:]

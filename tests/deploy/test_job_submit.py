"""A real `ray start --head` on loopback and `ray job submit` of a generate job.

`ray stop` stops every Ray on the machine, so this module must run before the session's shared Ray
starts (tests/deploy/test_modes.py is the first to use it; files run in name order). It skips if a
Ray is already up in this process.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.factories import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent



def test_ray_job_submit_runs_a_generate_job(tiny_checkpoint, tmp_path):
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray session is already up in this process; `ray stop` would end it")
    env = os.environ | {"PATH": f"{BIN}:{os.environ['PATH']}", "RAY_ADDRESS": ""}
    gcs, dashboard = free_port(), free_port()
    rows = [{"id": f"q{i}", "prompt_token_ids": [5 + i, 9, 14, 100], "max_tokens": 6, "temperature": 0}
            for i in range(4)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    subprocess.run([BIN / "ray", "start", "--head", f"--port={gcs}", "--node-ip-address=127.0.0.1",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=4",
                    "--include-dashboard=true", "--disable-usage-stats"],
                   check=True, env=env, capture_output=True, timeout=120)
    try:
        # the head enabled token authentication; the job client sends the token from ~/.ray/auth_token
        submit = [BIN / "ray", "job", "submit", f"--address=http://127.0.0.1:{dashboard}", "--working-dir", ROOT,
                  "--", "pdserve", "generate", "--mode", "disaggregated", "--model", tiny_checkpoint, "--input",
                  str(tmp_path / "in.jsonl"), "--output", str(out), "--max-model-len", "64"]
        for _ in range(10):  # right after `ray start` the node's job agent may not be up yet
            job = subprocess.run(submit, env=env | {"RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
                                 timeout=400)
            if "No available agent" not in job.stdout + job.stderr:
                break
            time.sleep(3)
        logs = job.stdout + job.stderr
        assert job.returncode == 0, logs[-4000:]
        assert "succeeded" in logs and "wrote 4 results" in logs
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [line["id"] for line in lines] == ["q0", "q1", "q2", "q3"]
        assert all(len(line["token_ids"]) == 6 and line["metrics"]["kv_handoff_bytes"] > 0 for line in lines)
    finally:
        subprocess.run([BIN / "ray", "stop", "--force"], env=env, capture_output=True, timeout=120)

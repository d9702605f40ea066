"""The default single-cell deployment survives the death of its scheduler, of its `Cell` replica,
of both, or of its decode worker: every stream ends with the no-fault run's text, and nothing is
left behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
FAULTS = ["scheduler", "replica", "both", "handoff", "burst", "worker"]


def test_streams_continue_through_scheduler_and_replica_deaths_and_no_actor_is_left(
    tiny_checkpoint,
):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.deploy.serving.restart_scenario", tiny_checkpoint, *FAULTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    reference = seen["reference"]
    assert reference["errors"] == [] and set(reference["tokens"]) == {900}
    for fault in FAULTS:
        # 12 greedy streams, SIGKILL mid-stream: none ends with an error, each with its no-fault
        # text, token for token
        run = seen[fault]
        assert run["errors"] == [], (fault, run["errors"])
        assert run["texts"] == reference["texts"], fault
        # the same scheduler and workers serve on: restarted or adopted, never replaced
        assert run["actors"] == seen["actors_before"], fault
    # the decode worker was held stopped: the scheduler died with prompts' handoffs in flight
    assert seen["handoff"]["handoffs_at_kill"] >= 1
    # the decode worker's death (the last fault) is counted where its streams were recomputed
    assert seen["counters"]["worker_failures"] >= 1 and seen["counters"]["recomputes"] >= 1
    # Ray's restarts of the scheduler are counted (scheduler, both, handoff)
    assert seen["counters"]["scheduler_restarts"] >= 3
    assert seen["metrics"] and float(seen["metrics"][0].split()[-1]) >= 3
    # a scale-down leaves one scheduler with its two workers; deleting the app leaves nothing
    assert len(seen["actors_two_cells"]) == 6
    (cell,) = [name for name in seen["actors_scaled_down"] if "/" not in name]
    assert seen["actors_scaled_down"] == [cell, f"{cell}/decode-0", f"{cell}/prefill-0"]
    assert seen["actors_deleted"] == []
    # deleted while its replica was dead: the cell stopped itself once no replica adopted it
    assert seen["actors_orphaned"] == [], seen["orphan_stopped_s"]

"""Cells behind the ingress on simulated nodes: failover that continues streams exactly,
autoscaling, broken cells."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def run_check(checkpoint: str, scenario: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.deploy.serving.cells_scenario", checkpoint, scenario],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def test_a_killed_scheduler_loses_no_stream_and_a_cell_without_workers_takes_no_request(
    tiny_checkpoint,
):
    seen = run_check(tiny_checkpoint, "failover")
    reference, fault = seen["reference"], seen["fault"]
    assert reference["errors"] == [] and set(reference["tokens"]) == {400}
    # 16 streams, the scheduler of the cell holding the most of them SIGKILLed mid-stream: every
    # stream whole (no error event, finish_reason, usage and [DONE]) and its text the unkilled
    # run's, token for token
    assert (
        fault["errors"] == []
        and fault["tokens"] == reference["tokens"]
        and fault["texts"] == reference["texts"]
    )
    assert seen["killed_cell_streams"] >= 1 and seen["failovers"] >= seen["killed_cell_streams"]
    # restarted in place by Ray (same scheduler, its workers found again), not replaced
    assert seen["killed"] in seen["cells_after_kill"] and len(seen["cells_after_kill"]) == 2
    # a cell whose workers are all gone: requests sent after it all succeed (each its text's start),
    # and Serve replaces the cell
    later = seen["later"]
    assert later["errors"] == [] and set(later["tokens"]) == {20}
    assert all(
        full.startswith(text) and text
        for full, text in zip(reference["texts"], later["texts"], strict=False)
    )
    assert seen["broken"] not in seen["cells_final"] and len(seen["cells_final"]) == 2


def test_cells_scale_up_and_down_under_streaming_load_with_no_stream_lost(tiny_checkpoint):
    seen = run_check(tiny_checkpoint, "scaling")
    assert seen["reference"]["errors"] == []
    assert seen["num_cells"] == [1, 2, 1]  # as /stats showed them: before, under load, after
    assert seen["requests"] > 12 and seen["mismatched"] == [] and seen["errors"] == []

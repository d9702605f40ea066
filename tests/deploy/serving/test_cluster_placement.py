"""Prefill and decode workers land on their own node types and the KV crosses nodes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def test_workers_land_on_their_node_types_and_outputs_equal_local(tiny_checkpoint):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.deploy.serving.cluster_placement_scenario", tiny_checkpoint],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["prefill_node"] != result["decode_node"]
    assert result["head"] not in (result["prefill_node"], result["decode_node"])
    assert result["equal"]
    assert result["handoff_bytes"] > 0

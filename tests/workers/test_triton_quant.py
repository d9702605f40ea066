"""The GPU matmul over packed quantized weights (`workers/triton_quant.py`), run on CPU tensors
under Triton's interpreter (`tests/workers/triton_checks.py`, in a process of its own): every
format against the dequantized weight's matmul, rows independent of their batch, bf16 activations,
a bias, and columns that end inside the last program's tile."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers.quant_cases import FORMATS

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("check", [*FORMATS, "bf16"])
def test_the_triton_matmul_under_the_interpreter(check):
    result = subprocess.run(
        [sys.executable, "-m", "tests.workers.triton_checks", check],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")

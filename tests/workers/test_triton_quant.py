"""The GPU matmul over packed quantized weights (`workers/triton_quant.py`), run on CPU tensors
under Triton's interpreter (`tests/workers/triton_checks.py`, in a process of its own): every
format against the dequantized weight's matmul, rows independent of their batch, bf16 activations,
a bias, and columns that end inside the last program's tile."""

import pytest

from tests.workers.interpreter import run_checks
from tests.workers.quant_cases import FORMATS

pytest.importorskip("triton")


@pytest.mark.parametrize("check", [*FORMATS, "bf16"])
def test_the_triton_matmul_under_the_interpreter(check):
    result = run_checks("tests.workers.triton_checks", check)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")

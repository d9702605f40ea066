"""The GPU paged attention (`workers/triton_attention.py`), run on CPU tensors under Triton's
interpreter (`tests/workers/triton_attention_checks.py`, in a process of its own): decode rows and
prompt chunks over shuffled and shared blocks against a float64 softmax and the torch ops, GQA
groups of 1, 4 and 7, head dims 64, 112 and 128, fp32 and bf16, decode rows split over spans, an
8-bit cache, and the model's attention wired to them against its torch ops."""

import pytest

from tests.workers.interpreter import run_checks

pytest.importorskip("triton")


# two processes: a process's start (torch, Triton) costs as much as a check
@pytest.mark.parametrize("checks", [["decode", "spans", "model"], ["prompt", "kv8"]])
def test_the_triton_attention_under_the_interpreter(checks):
    result = run_checks("tests.workers.triton_attention_checks", *checks)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")

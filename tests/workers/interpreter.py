"""Runs a module of Triton checks on CPU tensors under Triton's interpreter, in a process of its
own (TRITON_INTERPRET must be set before Triton is imported)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_checks(module: str, *checks: str) -> subprocess.CompletedProcess:
    """`python -m module checks...` from the repository root with TRITON_INTERPRET=1."""
    return subprocess.run(
        [sys.executable, "-m", module, *checks],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )

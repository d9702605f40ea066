"""A built wheel is the whole service: installed non-editable into a fresh venv, `pdserve` runs
from outside the checkout, with every subpackage and the files it reads beside its modules."""

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from workers import kernels

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "workers", "deploy")

pytestmark = pytest.mark.slow


def checkout_modules() -> set[str]:
    """Every module of the shipped packages in the checkout, as a path inside the wheel."""
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the checkout's sources (setuptools leaves a build/ folder beside
    them, whose stale modules a later build would pack)."""
    source = tmp_path_factory.mktemp("source")
    for name in (*PACKAGES, "benchmarks", "tests"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--wheel-dir", str(out), str(source)],
        check=True,
        cwd=source,
        capture_output=True,
    )
    (path,) = out.glob("pdserve-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with only the wheel installed; its dependencies come from the test's own
    environment through a path file (plain paths: the checkout's editable finder is not run)."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    (purelib,) = root.glob("lib/python*/site-packages")
    (purelib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install", "-q"]
        + ["--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    return root


def test_the_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert checkout_modules() - names == set()
    data = {n for n in names if n.startswith(("workers/", "deploy/")) and not n.endswith(".py")}
    assert "deploy/serve_config.yaml" in data and "deploy/grafana/pdserve.json" in data
    assert any(n.endswith(".cpp") for n in data)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_the_installed_pdserve_generates_from_outside_the_checkout(venv, tiny_checkpoint, tmp_path):
    python = str(venv / "bin" / "python")
    code = "import deploy.serving.app, workers.kernels as k; print(k.CSRC, k._machine_tag())"
    where = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-2000:]
    csrc, tag = where.stdout.split()
    assert Path(csrc).is_relative_to(venv), where.stdout
    # the installed kernels' sources are the checkout's, byte for byte, so they build the module
    # the suite builds (not built again here: torch rebuilds for a new source path, a minute of
    # two cores, and again for the checkout after)
    assert tag == kernels._machine_tag()
    assert {f.name: f.read_bytes() for f in Path(csrc).iterdir()} == {
        f.name: f.read_bytes() for f in kernels.CSRC.iterdir()
    }
    help_text = subprocess.run(
        [str(venv / "bin" / "pdserve"), "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert help_text.returncode == 0 and "generate" in help_text.stdout, help_text.stderr[-2000:]
    rows = [{"id": "a", "prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = subprocess.run(
        [str(venv / "bin" / "pdserve"), "generate", "--model", tiny_checkpoint, "--mode", "local"]
        + ["--input", "in.jsonl", "--output", "out.jsonl", "--quiet"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=os.environ | {"PDSERVE_KERNELS": "0"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = (tmp_path / "out.jsonl").read_text().splitlines()
    result = json.loads(line)
    assert result["id"] == "a" and len(result["token_ids"]) == 6, result

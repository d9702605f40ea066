"""The layout keeps the architecture: imports point deploy -> workers -> scheduler, and scheduler/ is pure."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import scheduler

ROOT = Path(__file__).resolve().parents[1]
RANK = {"scheduler": 0, "workers": 1, "deploy": 2}
SHELL = "scheduler.cell.actor"  # the one module of scheduler/ that may import ray


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, wherever the import sits (top level, function, TYPE_CHECKING)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def project_files():
    for package in RANK:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            yield package, module, path


def test_imports_point_one_way():
    upward = [(module, name) for package, module, path in project_files() for name in imported_modules(path)
              if name.split(".")[0] in RANK and RANK[name.split(".")[0]] > RANK[package]]
    assert upward == []


def test_nothing_in_scheduler_imports_the_actor_shell():
    importers = [module for package, module, path in project_files()
                 if package == "scheduler" and module != SHELL and SHELL in imported_modules(path)]
    assert importers == []


def test_every_pure_scheduler_module_imports_neither_torch_nor_ray_nor_numpy():
    pure = [f"scheduler.{m.name}" for m in pkgutil.iter_modules(scheduler.__path__) if f"scheduler.{m.name}" != SHELL]
    assert len(pure) >= 8  # the walk found the package's modules
    code = (f"import sys; import {', '.join(pure)}; "
            "bad = [m for m in ('torch', 'ray', 'numpy') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_pdserve_help_loads_no_torch():
    code = ("import sys\nfrom deploy.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n"
            "    pass\nassert 'torch' not in sys.modules and 'ray' not in sys.modules, 'heavy imports'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--token-budget" in result.stdout and "--sweep-slots" in result.stdout


def test_no_file_is_over_300_lines():
    long = {str(path.relative_to(ROOT)): n for _, _, path in project_files()
            if (n := len(path.read_text().splitlines())) > 320}
    assert long == {}

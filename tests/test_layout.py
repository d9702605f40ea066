"""The layout keeps the architecture: imports point benchmarks -> deploy -> workers -> scheduler,
and scheduler/ is pure."""

import ast
import io
import pkgutil
import subprocess
import sys
import tokenize
from pathlib import Path

import scheduler

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/ is the lab beside the service: it may use every package, and none may use it
RANK = {"scheduler": 0, "workers": 1, "deploy": 2, "benchmarks": 3}
SHELL = "scheduler.cell.actor"  # the one module of scheduler/ that may import ray
MAX_LINES = 500  # a cohesive file may reach about 450 lines


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, wherever the import sits (top level, function,
    TYPE_CHECKING)."""
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
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(
                ".__init__"
            )
            yield package, module, path


def test_imports_point_one_way():
    upward = [
        (module, name)
        for package, module, path in project_files()
        for name in imported_modules(path)
        if name.split(".")[0] in RANK and RANK[name.split(".")[0]] > RANK[package]
    ]
    assert upward == []


def test_nothing_in_scheduler_imports_the_actor_shell():
    importers = [
        module
        for package, module, path in project_files()
        if package == "scheduler" and module != SHELL and SHELL in imported_modules(path)
    ]
    assert importers == []


def test_every_pure_scheduler_module_imports_neither_torch_nor_ray_nor_numpy():
    pure = [
        m.name for m in pkgutil.walk_packages(scheduler.__path__, "scheduler.") if m.name != SHELL
    ]
    assert "scheduler.cell.coordinator" in pure  # the walk went into the cell runtime
    code = (
        f"import sys; import {', '.join(pure)}; "
        "bad = [m for m in ('torch', 'ray', 'numpy') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_step_planner_does_not_reach_into_the_cell_runtime():
    """scheduler/ is two layers: the planner and its data at the top, the cell runtime (actor,
    coordinator, handoffs...) in scheduler/cell/ above it."""
    upward = [
        (module, name)
        for package, module, path in project_files()
        if package == "scheduler" and not module.startswith("scheduler.cell")
        for name in imported_modules(path)
        if name.startswith("scheduler.cell")
    ]
    assert upward == []


def test_the_configuration_imports_no_serving_code():
    assert not [n for n in imported_modules(ROOT / "deploy" / "config.py") if "serving" in n]


def test_pdserve_help_loads_no_torch():
    code = (
        "import sys\nfrom deploy.cli import main\ntry:\n    main(['bench', '--help'])\nexcept "
        "SystemExit:\n"
        "    pass\nassert 'torch' not in sys.modules and 'ray' not in sys.modules, 'heavy imports'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--token-budget" in result.stdout and "--sweep-slots" in result.stdout


def test_every_file_says_its_one_job_in_its_first_line():
    """A file does one job and its docstring's first line says which; split by job, never by
    length. A file past MAX_LINES has probably grown a second job: split it where the jobs part."""
    unsaid = []
    long = {}
    for _, module, path in project_files():
        text = path.read_text()
        tree = ast.parse(text)
        doc = ast.get_docstring(tree)
        if module.count(".") and path.name != "__init__.py" and not (doc and doc.strip()):
            unsaid.append(module)
        if (num_lines := len(text.splitlines())) > MAX_LINES:
            long[module] = num_lines
    assert unsaid == []
    assert long == {}


def test_lines_read_one_statement_at_a_time():
    """At most 100 characters a line (ruff's E501 checks the same) and no backslash
    continuations outside strings: a reader takes one statement per line."""
    wide = []
    continued = []
    for _, module, path in project_files():
        text = path.read_text()
        lines = text.splitlines()
        wide += [f"{module}:{n}" for n, line in enumerate(lines, 1) if len(line) > 100]
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        string_lines = set()
        for token in tokens:
            if token.type == tokenize.STRING:
                string_lines.update(range(token.start[0], token.end[0] + 1))
        continued += [
            f"{module}:{n}"
            for n, line in enumerate(lines, 1)
            if line.endswith("\\") and n not in string_lines
        ]
    assert wide == []
    assert continued == []


def test_no_test_module_is_imported():
    """What tests share lives in helper modules beside them (`tests/factories.py`, `cells.py`,
    `engines.py`...), not in `test_*` modules: no file under tests/ imports one."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                names = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            found += [
                f"{path.relative_to(tests.parent)}: {name}"
                for name in names
                if name.startswith(("tests.", "."))
                and any(part.startswith("test_") for part in name.split("."))
            ]
    assert found == []

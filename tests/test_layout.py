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


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, wherever the import sits (top level, function,
    TYPE_CHECKING); `from package import module` names the project's module too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {
                f"{node.module}.{alias.name}"
                for alias in node.names
                if _is_project_module(f"{node.module}.{alias.name}")
            }
    return names


def _is_project_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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


def import_graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports (anywhere in the file)."""
    files = {module: path for _, module, path in project_files()}
    return {module: imported_modules(path) & files.keys() for module, path in files.items()}


def test_no_import_circles():
    """No module imports, even inside a function or under TYPE_CHECKING, a module that imports it
    back, directly or through others: a class cut in two leaves such a circle behind."""
    graph = import_graph()
    assert "workers.loader" in graph["workers.actors"]  # (the graph has edges)
    done: set[str] = set()
    circles = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append(" -> ".join(path[path.index(module) :] + [module]))
            return
        if module in done:
            return
        for name in sorted(graph[module]):
            visit(name, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert circles == []


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
    length (a cohesive class may be long: vLLM's scheduler is one file)."""
    unsaid = []
    for _, module, path in project_files():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if module.count(".") and path.name != "__init__.py" and not (doc and doc.strip()):
            unsaid.append(module)
    assert unsaid == []


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


def test_every_cpp_file_says_its_one_job_in_its_first_line():
    """C++ lives in .cpp/.h files of its own (workers/csrc/), each opening with a comment that
    says its job, and reads as the Python does: at most 100 characters a line."""
    files = sorted((ROOT / "workers" / "csrc").iterdir())
    assert {path.suffix for path in files} == {".cpp", ".h"}
    unsaid = [path.name for path in files if not path.read_text().startswith("// ")]
    wide = [
        f"{path.name}:{n}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert unsaid == []
    assert wide == []


def _abstract_base(node: ast.ClassDef) -> bool:
    """An ABC or a Protocol (its methods may be stubs for the classes that implement it)."""
    bases = [b.value if isinstance(b, ast.Subscript) else b for b in node.bases]
    names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in bases}
    metaclasses = {ast.unparse(k.value) for k in node.keywords if k.arg == "metaclass"}
    return bool(names & {"ABC", "Protocol"} or metaclasses & {"ABCMeta", "abc.ABCMeta"})


def _only_raises_not_implemented(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def test_no_method_is_a_stub_outside_an_abstract_base():
    """A method whose body only raises NotImplementedError belongs to an abstract base (ABC,
    Protocol); anywhere else it stands for a host's method in a class cut in half (a mixin)."""
    stubs = [
        f"{module}.{node.name}.{function.name}"
        for _, module, path in project_files()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef) and not _abstract_base(node)
        for function in node.body
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        and _only_raises_not_implemented(function)
    ]
    assert stubs == []


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
